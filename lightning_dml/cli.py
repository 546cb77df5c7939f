"""The ``lightning-dml`` command: a ``LightningCLI`` with ``fit``, ``validate``, ``test`` and ``predict``, and the
library's own commands (:data:`COMMANDS`: ``cv``, ``sweep``, ``report``, ``index``, ``search``, ``serve``).

Configs name every class by ``class_path``/``init_args`` (backbone, loss, data module, logger), so jsonargparse
validates every key, including the loss's own arguments::

    lightning-dml fit --config configs/glyphs.yaml
    lightning-dml fit --config configs/glyphs.yaml --model.loss.init_args.beta 40
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jsonargparse import DefaultHelpFormatter, Namespace
from pytorch_lightning import Callback, Trainer
from pytorch_lightning.callbacks import BasePredictionWriter, ModelCheckpoint
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from pytorch_lightning.loggers import WandbLogger
from pytorch_lightning.utilities import rank_zero_only

from lightning_dml import __version__
from lightning_dml.callbacks import PeriodicCheckpoint, PredictionWriter, ValidationSummary
from lightning_dml.callbacks.pairwise_test import PairwiseRerankTest
from lightning_dml.callbacks.predictions import check_output_path
from lightning_dml.cli_parsing import exit_with_error, instantiation_reason, option_names
from lightning_dml.checkpoints import (
    EVALUATION_HPARAMS,
    CheckpointMismatchError,
    hparams_disagreements,
    is_local_file_path,
    is_url,
    local_checkpoint,
    read_checkpoint,
)
from lightning_dml.data.base import DMLDataModule
from lightning_dml.download import env_flag
from lightning_dml.entry import COMMANDS, TRAINER_COMMANDS
from lightning_dml.entry import main as entry_main
from lightning_dml.errors import CorruptFileError, UserInputError
from lightning_dml.module import DERIVED_HPARAMS, DMLModule
from lightning_dml.run_config import SaveRunConfig
from lightning_dml.runs import check_checkpoint_folders, remove_checkpoints, slurm_requeue_resumes


def load_data_modules() -> None:
    """Import every data module of :mod:`lightning_dml.data` (which imports them on first use), so that
    jsonargparse knows each by its class name alone (``--data CSVDataModule``, ``--data.help CSVDataModule``)."""
    import lightning_dml.data as data

    for name in data.__all__:
        getattr(data, name)


load_data_modules()

#: Trainer defaults of the ``lightning-dml`` command (a user's ``trainer_defaults`` to :class:`DMLCLI` adds to them)
TRAINER_DEFAULTS: dict[str, Any] = {
    "logger": {
        "class_path": "pytorch_lightning.loggers.WandbLogger",
        "init_args": {"project": "lightning-dml", "offline": True, "save_dir": "logs"},
    },
    "num_sanity_val_steps": 0,
    # P x K batches come from BalancedClassSampler, which shards them by rank itself; Lightning's
    # DistributedSampler replacement would deal each process every world-size-th index instead.
    "use_distributed_sampler": False,
}




def _help_texts() -> dict[str, str]:
    """``description`` and ``epilog`` of the ``lightning-dml`` parser: the library, and every command."""
    names = ", ".join([*TRAINER_COMMANDS, *COMMANDS])
    width = max(len(name) for name in COMMANDS) + 2
    lines = [f"  {name:<{width}}{text}" for name, (_, text) in COMMANDS.items()]
    return {
        "description": (
            f"lightning-dml {__version__}: deep metric learning with PyTorch Lightning (the lightning_dml "
            f"library).\nCommands: {names}. `lightning-dml <command> --help` shows a command's options."
        ),
        "epilog": "more commands (each with its own --help):\n" + "\n".join(lines),
    }


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help format, with the description and epilog printed as written (one command a line)."""


class DMLArgumentParser(LightningArgumentParser):
    """The parser of ``lightning-dml`` and of each of its LightningCLI commands: no abbreviated options
    (``allow_abbrev=False``), and a command-line or config-file error is one line naming the closest valid options
    or keys, without the usage block (:func:`lightning_dml.cli_parsing.explain`). Errors raised inside a parse
    (``exit_on_error=False``) stay jsonargparse's. ``command``: the LightningCLI subcommand the parser is of
    (``None``: the main parser), so that a command's own options go to its parser only."""

    def __init__(self, *args: Any, allow_abbrev: bool = False, command: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)
        self.command = command

    def error(self, message: str, ex: Exception | None = None) -> Any:
        if not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        exit_with_error(parser.prog.replace(" [options]", ""), message, option_names(parser.format_help()))


class _DropLightningTips(logging.Filter):
    """Drops Lightning's advertisements from its console log: the ``💡 Tip:`` lines for litlogger and litmodels that
    ``Trainer`` prints (``rank_zero_info``) whenever no ``LitLogger`` is configured."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.getMessage())
        return not (message.startswith("💡 Tip") or "pypi.org/project/lit" in message)


def quiet_dependency_warnings(command: str | None = None) -> None:
    """Drop the warnings of Lightning and torch that say nothing to a user of ``lightning-dml`` (each filtered by its
    message and the module that raises it; every other warning is kept):

    * torch's "``isinstance(treespec, LeafSpec)`` is deprecated" (a FutureWarning), raised by Lightning's own
      ``pytorch_lightning.utilities._pytree`` whenever it flattens a batch (every command that runs a loop);
    * for ``validate``, ``test`` and ``predict`` (``command``), ``ModelCheckpoint``'s "The dirpath has changed from
      ..." when the checkpoint read was written into another folder: these commands save no checkpoint, so the
      checkpoint's best-model bookkeeping they do not reload is never used. ``fit`` keeps it (a resumed run's
      checkpoint folder did change).
    """
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"pytorch_lightning\.utilities\._pytree",
    )
    if command in ("validate", "test", "predict"):
        warnings.filterwarnings(
            "ignore", message=r"The dirpath has changed from", module=r"pytorch_lightning\.callbacks\.model_checkpoint"
        )


def quiet_lightning_tips() -> None:
    """Attach :class:`_DropLightningTips` to the loggers Lightning's ``rank_zero_info`` writes to (Python logging's
    own way to drop records; every other Lightning message is kept). Idempotent."""
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropLightningTips) for f in log.filters):
            log.addFilter(_DropLightningTips())


def _wandb_offline(logger_config: Any) -> bool | None:
    """Whether the parsed ``trainer.logger`` (a ``class_path``/``init_args`` namespace or a list of them) has an
    offline ``WandbLogger`` (``None``: no ``WandbLogger`` in it)."""
    configs = logger_config if isinstance(logger_config, (list, tuple)) else [logger_config]
    found = None
    for config in configs:
        if isinstance(config, (dict, Namespace)) and str(config.get("class_path", "")).endswith("WandbLogger"):
            found = bool(found) or bool((config.get("init_args") or {}).get("offline"))
    return found


@rank_zero_only
def _setup_wandb(offline: bool | None) -> None:
    """``wandb.setup()`` before the configured ``WandbLogger`` starts its run (``offline is None``: none is).

    Lightning's ``WandbLogger`` passes ``anonymous=None`` to ``wandb.init`` whatever it is given, and W&B (0.23
    and later) warns "The anonymous setting has no effect" for any value, before ``wandb.init`` has read the
    environment: the warning reaches the terminal even with ``WANDB_SILENT=true`` (the CLI's default). W&B's
    public ``setup`` applies the environment first, so the deprecation notice goes where W&B's other messages
    go. An offline logger sets ``WANDB_MODE`` only when it starts its run; it is set here first (as the logger
    would), so that ``setup`` does not prepare an online session that asks for an API key.
    """
    if offline is None:
        return
    import wandb

    if offline:
        os.environ["WANDB_MODE"] = "offline"  # what WandbLogger(offline=True) sets ("dryrun", the old name)
    wandb.setup()


def _as_list(callbacks: Any) -> list[Callback]:
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


@rank_zero_only
def _warn(message: str) -> None:
    print(f"lightning-dml: warning: {message}", file=sys.stderr, flush=True)


class DMLCLI(LightningCLI):
    """LightningCLI with the library's defaults: W&B logging offline, no sanity validation on partial data,
    checkpoints a preempted run can resume from, and the last validation metrics printed when ``fit`` ends.

    Checkpoints (both in ``<trainer.default_root_dir>/checkpoints`` unless ``--checkpoint.dirpath`` is given, so
    the same command plus ``--ckpt_path last`` resumes a run; give each run its own ``default_root_dir``: a fit
    into a checkpoint folder holding another run's checkpoints is refused unless it resumes or is given
    ``--overwrite_checkpoints true``, see :meth:`before_fit`):

    * ``--checkpoint.*``: a ``ModelCheckpoint`` keeping the best validation by ``val/recall@1``
      (``best-epoch=..-step=...ckpt``); ``ckpt_path="best"`` after ``fit`` uses it.
    * ``--periodic_checkpoint.*``: :class:`~lightning_dml.callbacks.PeriodicCheckpoint`, ``last.ckpt`` every
      ``every_n_train_steps`` training steps (mid-epoch) and at every epoch end.

    ``--trainer.enable_checkpointing false`` turns both off.

    ``predict`` writes ``predictions.pt`` into the run's folder (:func:`~lightning_dml.runs.run_folder`;
    embeddings, labels, indices, image paths, the checkpoint), or the file ``--output`` names,
    with a :class:`~lightning_dml.callbacks.PredictionWriter`, unless ``--trainer.callbacks`` already has a
    prediction writer. Every run has a :class:`~lightning_dml.callbacks.ValidationSummary` (given through
    Lightning's ``trainer_defaults``), which prints the last validation metrics at the end of ``fit``.

    Every ``fit`` ends with its metrics: with ``--validate_at_end true`` (the default) a fit whose last training
    steps were not validated (it stopped at ``max_steps`` or ``max_time`` between two validations, or before the
    first) is validated once more when it ends (``after_fit``), and the table shows that validation. A fit whose
    last step was validated is not validated again. This final validation is not seen by ``--checkpoint``
    (Lightning saves checkpoints during ``fit`` only), so ``best-*.ckpt`` is the best of the in-fit validations.

    Checkpoints a run starts from (``--ckpt_path``):

    * a file that does not exist, is empty, truncated, not a checkpoint or holds pickled code is one error naming
      the file and what is wrong with it (:func:`~lightning_dml.checkpoints.read_checkpoint`); an ``http(s)://``
      checkpoint is downloaded to the cache and read the same way (Lightning never loads the URL itself);
    * the model's hyper-parameters come from the checkpoint (LightningCLI's behaviour), and a value the config or
      the command line gives that differs from the checkpoint's (``--model.embedding_dim 32`` for a checkpoint
      of width 16) is an error naming the key and both values, never silently replaced; the evaluation settings
      (``metrics``, ``recall_at``, ``clustering``) may differ and are the given ones
      (:meth:`before_instantiate_classes`);
    * ``validate``, ``test`` and ``predict`` without ``--ckpt_path`` evaluate the configuration's initial weights
      (a random head): one warning line says so, and the run records ``checkpoint: null`` (the logged
      hyper-parameters, the predictions file).

    Customised through LightningCLI's public hooks only: ``trainer_defaults``, ``parser_kwargs`` (the help's
    description and the list of every command), ``add_arguments_to_parser`` (the two checkpoint groups are parsed
    but not instantiated by jsonargparse), ``parse_arguments`` (the ``--ckpt_path`` checks, before LightningCLI
    reads the checkpoint's hyper-parameters), ``before_<command>``/``after_fit`` and ``instantiate_trainer``, which
    builds the checkpoint callbacks from the parsed groups and hands them to ``LightningCLI.instantiate_trainer``
    as ``callbacks`` with the user's. The saved ``config.yaml`` stays what the user gave.
    """

    def __init__(
        self,
        *args: Any,
        trainer_defaults: dict[str, Any] | None = None,
        parser_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        quiet_lightning_tips()
        #: prints the metrics table at the end of fit (after the final validation, if one runs)
        self.validation_summary = ValidationSummary()
        defaults = {**TRAINER_DEFAULTS, **(trainer_defaults or {})}
        defaults["callbacks"] = [*_as_list(defaults.get("callbacks")), self.validation_summary]
        parser_kwargs = {
            **_help_texts(),
            "formatter_class": _HelpFormatter,
            "prog": "lightning-dml",
            **{command: {"prog": f"lightning-dml {command}", "command": command} for command in TRAINER_COMMANDS},
            **(parser_kwargs or {}),
        }
        kwargs.setdefault("parser_class", DMLArgumentParser)
        super().__init__(*args, trainer_defaults=defaults, parser_kwargs=parser_kwargs, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        # No link for data.init_args.input_spec: the data module reads the backbone's input convention at set-up
        # (DMLDataModule.adopt_input_spec), and a link would silently replace an input_spec set in the config.
        # parsed and validated, instantiated by instantiate_trainer (only when checkpointing is on)
        parser.add_class_arguments(ModelCheckpoint, "checkpoint", instantiate=False, fail_untyped=False)
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/recall@1",
                "checkpoint.mode": "max",
                "checkpoint.save_top_k": 1,
                "checkpoint.save_last": False,  # last.ckpt is the periodic checkpoint's
                "checkpoint.filename": "best-{epoch}-{step}",
            }
        )
        parser.add_class_arguments(PeriodicCheckpoint, "periodic_checkpoint", instantiate=False, fail_untyped=False)
        parser.add_argument(
            "--validate_at_end",
            type=bool,
            default=True,
            help="fit: validate once more when fit ends after training steps that no validation saw (stopped at "
            "max_steps or max_time between two validations), so that every fit ends with its metrics",
        )
        parser.add_argument(
            "--overwrite_checkpoints",
            type=bool,
            default=False,
            help="fit: replace the checkpoints another run left in the checkpoint folder (without it such a fit "
            "is refused unless it resumes with --ckpt_path last; lightning_dml/runs.py)",
        )
        # on every command, as the options above: a config dumped from the main parser (sweep's best.yaml, cv's
        # fold configs) holds ``output: null`` and must load in ``fit``; a value is refused outside predict
        # (parse_arguments)
        parser.add_argument(
            "--output",
            type=str | None,
            default=None,
            help="predict: the file predict writes (default: predictions.pt in the run's folder); written "
            "atomically, its path and contents printed; a folder or a place that cannot be written is refused "
            "before the model runs",
        )
        parser.add_argument(  # on every command as --output (a dumped config holds rerank: null); test uses it
            "--rerank",
            type=str | None,
            default=None,
            help="test: also the metrics of the exact ranked lists with each query's first top_n re-scored by a "
            "learned pairwise re-ranker, pairwise:model=DIR,top_n=N (printed as pairwise/...; docs/reranking.md)",
        )

    # ------------------------------------------------------------------------------------- the checkpoint to load
    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parse as LightningCLI does, then check ``--ckpt_path`` (:meth:`check_checkpoint`) before LightningCLI
        reads the checkpoint's hyper-parameters into the config."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        quiet_dependency_warnings(subcommand)
        if subcommand and subcommand != "predict" and self.config[subcommand].get("output") is not None:
            raise UserInputError(f"--output is an option of predict; {subcommand} writes no predictions file")
        if subcommand and subcommand != "test" and self.config[subcommand].get("rerank") is not None:
            raise UserInputError(f"--rerank is an option of test; {subcommand} re-ranks nothing")
        self.check_checkpoint(parser, args)

    def check_checkpoint(self, parser: Any, args: Any) -> None:
        """One clear error for a ``--ckpt_path`` that cannot be used, before LightningCLI reads it.

        * ``best`` names the best checkpoint of a fit earlier in the same process: a ``lightning-dml`` command
          runs one, so it is an error here (name the file);
        * a local file is read (:func:`~lightning_dml.checkpoints.read_checkpoint`): missing, empty, truncated,
          not a checkpoint, or holding pickled code objects is one error naming the file; an ``http(s)://`` URL is
          downloaded to the cache first (:func:`~lightning_dml.checkpoints.local_checkpoint`) and that copy is read
          the same way and handed to Lightning (other URL schemes are refused);
        * its model hyper-parameters must be ones this model takes, and every one of them that the config or the
          command line gives must equal the checkpoint's (LightningCLI would silently replace the given value by
          the checkpoint's): :class:`~lightning_dml.checkpoints.CheckpointMismatchError` naming each key and both
          values. The values not given come from the checkpoint.

        ``last`` is resolved by Lightning when the run starts; :meth:`DMLModule.on_load_checkpoint
        <lightning_dml.module.DMLModule.on_load_checkpoint>` then compares every hyper-parameter.
        """
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        ckpt_path = self.config[subcommand].get("ckpt_path")
        if ckpt_path is None:
            return
        if str(ckpt_path) == "best":
            raise UserInputError(
                "--ckpt_path best means the best checkpoint of a fit run earlier in the same process, and "
                f"`lightning-dml {subcommand}` runs none: give the checkpoint file (the fit wrote "
                "<default_root_dir>/checkpoints/best-epoch=...ckpt)"
            )
        if is_url(ckpt_path):  # Lightning would unpickle a URL's file (weights_only=False): read the download here
            ckpt_path = str(local_checkpoint(ckpt_path, what="--ckpt_path"))
            self.config[subcommand]["ckpt_path"] = ckpt_path
        if not is_local_file_path(ckpt_path):
            return  # last/hpc/registry: Lightning resolves and reads them
        if os.path.isdir(ckpt_path):
            strategy = str(self.config[subcommand].get("trainer", {}).get("strategy", "")).lower()
            if "fsdp" in strategy or "deepspeed" in strategy:
                return  # a sharded checkpoint is a folder
            files = sorted(p.name for p in Path(ckpt_path).glob("*.ckpt"))
            inside = f": it holds {', '.join(files[:4])}{', ...' if len(files) > 4 else ''}" if files else ""
            raise CorruptFileError(f"--ckpt_path {ckpt_path} is a folder, not a checkpoint file{inside}")
        checkpoint = read_checkpoint(ckpt_path, what="--ckpt_path")
        hparams = {k: v for k, v in (checkpoint.get("hyper_parameters") or {}).items() if not k.startswith("_")}
        model_class = self.model_class if isinstance(self.model_class, type) else None
        if model_class is not None and hparams:
            accepted = inspect.signature(model_class.__init__).parameters
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
                unknown = sorted(set(hparams) - set(accepted))
                if unknown:
                    raise CheckpointMismatchError(
                        f"--ckpt_path {ckpt_path} has model hyper-parameters that {model_class.__name__} does not "
                        f"take: {', '.join(unknown)} (written by another model class or another version of "
                        "lightning-dml)"
                    )
        if isinstance(args, (dict, Namespace)):
            given = parser.parse_object(args, defaults=False)
        else:
            given = parser.parse_args(args, defaults=False)  # what the config files and the command line give
        given_model = (given.get(subcommand) or {}).get("model") or {}
        # evaluation settings the user gives win over the checkpoint's (re-applied in before_instantiate_classes)
        self.given_evaluation = {k: given_model[k] for k in EVALUATION_HPARAMS if given_model.get(k) is not None}
        disagreements = [  # a derived value left to be filled in (a fit's saved config.yaml) is not given
            (key, mine, theirs) for key, mine, theirs in hparams_disagreements(hparams, given_model)
            if not (mine is None and key.split(".")[0] in DERIVED_HPARAMS)
        ]
        if disagreements:
            details = "; ".join(
                f"model.{key}: the config or command line gives {mine!r}, the checkpoint {theirs!r}"
                for key, mine, theirs in disagreements
            )
            raise CheckpointMismatchError(
                f"--ckpt_path {ckpt_path} was saved with other model hyper-parameters than the ones given: {details}. "
                "Leave these keys out to use the checkpoint's values, or give the checkpoint of such a model"
            )

    def instantiate_classes(self) -> None:
        """LightningCLI's instantiation, where a class of the configuration that refuses its arguments (a
        ``ValueError`` or ``TypeError`` of its constructor, ``--model.loss.init_args.alpha -1``: "alpha must be > 0")
        is one line naming the reason, status 2 as for every configuration error, not jsonargparse's traceback
        (``--debug`` keeps it)."""
        try:
            super().instantiate_classes()
        except UserInputError:
            raise  # the library's own refusals keep their message and status (lightning_dml.entry.main)
        except (ValueError, TypeError) as error:
            if env_flag("LIGHTNING_DML_DEBUG"):
                raise
            prog = f"lightning-dml {self.subcommand}" if self.subcommand else "lightning-dml"
            exit_with_error(prog, f"the configuration was refused: {instantiation_reason(error)}", [])

    def before_instantiate_classes(self) -> None:
        """Give back the evaluation settings (:data:`~lightning_dml.checkpoints.EVALUATION_HPARAMS`: ``metrics``,
        ``recall_at``, ``clustering``) that the config or the command line gave and LightningCLI replaced by the
        checkpoint's when it read ``--ckpt_path``: ``test --ckpt_path X --model.metrics "[mrr, ndcg@5]"`` computes
        these metrics with X's model. Architecture, loss and optimisation settings stay the checkpoint's
        (:meth:`check_checkpoint` refuses different ones)."""
        subcommand = self.config.get("subcommand")
        given = getattr(self, "given_evaluation", None)
        if subcommand and given:
            for key, value in given.items():
                self.config[subcommand]["model"][key] = value

    def _warn_without_checkpoint(self, command: str) -> None:
        if self.config[command].get("ckpt_path") is None:
            _warn(
                f"{command} without --ckpt_path runs the configuration's initial weights (a randomly initialised "
                "embedding head, no trained model); give --ckpt_path to use a checkpoint"
            )

    def _one_metrics_table(self, command: str) -> None:
        """``validate`` and ``test`` print one table, in the one printed format (``docs/metrics.md``, "Printed
        values"): the :class:`~lightning_dml.callbacks.ValidationSummary`'s. Lightning's own table (the logged
        fractions: 0.7875 beside our 78.75) is turned off through the public ``Trainer.validate``/``test`` argument
        ``verbose=False``; the user's ``--verbose`` (default ``true``) decides whether ours is printed."""
        options = self.config_init[command]
        self.validation_summary.verbose = options.get("verbose") is not False
        options["verbose"] = False  # what LightningCLI passes to Trainer.validate/test (read after this hook)

    def before_validate(self) -> None:
        self._warn_without_checkpoint("validate")
        self._one_metrics_table("validate")

    def before_test(self) -> None:
        self._warn_without_checkpoint("test")
        self._one_metrics_table("test")
        ckpt_path = self.config_init["test"].get("ckpt_path")
        for callback in self.trainer.callbacks:  # --rerank: its folder and base checkpoint before the model runs
            if isinstance(callback, PairwiseRerankTest) and (ckpt_path is None or os.path.isfile(ckpt_path)):
                callback.check_checkpoint(ckpt_path)  # else (last, hpc) when Lightning has resolved it

    def before_predict(self) -> None:
        """The warning without ``--ckpt_path``; ``--output`` checked (:func:`~lightning_dml.callbacks.predictions.
        check_output_path`) before the model runs."""
        self._warn_without_checkpoint("predict")
        output = self.config_init["predict"].get("output")
        if output is not None:
            writer = next(cb for cb in self.trainer.callbacks if isinstance(cb, BasePredictionWriter))
            if not isinstance(writer, PredictionWriter) or writer.output_path != output:
                raise UserInputError(
                    f"--output {output} and the prediction writer of --trainer.callbacks "
                    f"({type(writer).__name__}): give one of them"
                )
            writer.output_path = str(check_output_path(output))

    # ------------------------------------------------------------------------------------- the end of fit
    def before_fit(self) -> None:
        """Refuse a fit that would replace another run's checkpoints (:func:`~lightning_dml.runs.
        check_checkpoint_folders`: unless it resumes, ``--ckpt_path last``, or ``--overwrite_checkpoints true``,
        which removes them here, on global rank 0, before the first step)."""
        config = self.config["fit"]
        self.validation_summary.final_validation = bool(config.get("validate_at_end", True))
        folders = [cb.dirpath for cb in self.trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        ckpt_path = config.get("ckpt_path")
        if ckpt_path is None and slurm_requeue_resumes(self.trainer.default_root_dir):
            ckpt_path = "hpc"  # Lightning resumes the requeued job from its hpc_ckpt_*.ckpt
        replaced = check_checkpoint_folders(folders, ckpt_path, bool(config.get("overwrite_checkpoints")))
        if replaced and self.trainer.is_global_zero:
            remove_checkpoints(replaced)
            _warn(f"--overwrite_checkpoints: removed {len(replaced)} checkpoint(s) of an earlier run from "
                  f"{', '.join(str(f) for f in dict.fromkeys(p.parent for p in replaced))}")

    def after_fit(self) -> None:
        """The final validation of ``--validate_at_end`` (see the class docstring), then the metrics table.

        LightningCLI's ``after_fit`` runs in every process of a DDP run (each runs the command), where
        ``Trainer.validate`` is the public way to validate: Lightning offers no public way to make ``fit``
        itself validate at a step its schedule skips, and a callback cannot call ``Trainer.validate`` from
        inside ``fit``. Whether the last validation is stale is decided from the step counts, equal on every
        process, so all processes validate or none does.
        """
        summary = self.validation_summary
        trainer = self.trainer
        if not summary.final_validation or trainer.interrupted or not summary.is_stale(trainer):
            return
        trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        summary.validated_step = trainer.global_step
        summary.print_table(trainer)

    def checkpoint_callbacks(self, trainer_config: dict[str, Any]) -> list[ModelCheckpoint]:
        """The ``--checkpoint`` and ``--periodic_checkpoint`` callbacks, both saving to one folder (none when
        ``enable_checkpointing`` is false)."""
        if trainer_config.get("enable_checkpointing") is False:
            return []
        config = self.config_init.get(str(self.subcommand), self.config_init)
        groups = {"checkpoint": ModelCheckpoint, "periodic_checkpoint": PeriodicCheckpoint}
        init = {key: {**config[key]} for key in groups}
        given = next((args["dirpath"] for args in init.values() if args.get("dirpath") is not None), None)
        root = trainer_config.get("default_root_dir") or os.getcwd()
        folder = given or os.path.realpath(os.path.join(os.path.expanduser(str(root)), "checkpoints"))
        return [cls(**{**init[key], "dirpath": init[key].get("dirpath") or folder}) for key, cls in groups.items()]

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer with the user's callbacks, the checkpoint callbacks and, for ``predict``, a
        :class:`~lightning_dml.callbacks.PredictionWriter` unless the user gave a prediction writer."""
        config = self.config_init.get(str(self.subcommand), self.config_init)
        trainer_config = {**config.get("trainer", {}), **kwargs}
        callbacks = [*_as_list(trainer_config.get("callbacks")), *self.checkpoint_callbacks(trainer_config)]
        if self.subcommand == "predict" and not any(isinstance(cb, BasePredictionWriter) for cb in callbacks):
            callbacks.append(PredictionWriter(config.get("output")))
        if self.subcommand == "test" and config.get("rerank") is not None:  # the learned re-ranker's metrics
            callbacks.append(PairwiseRerankTest(config["rerank"]))
        trainer = super().instantiate_trainer(**{**kwargs, "callbacks": callbacks})
        if "logger" not in kwargs and any(isinstance(logger, WandbLogger) for logger in trainer.loggers):
            parsed = self.config.get(str(self.subcommand), self.config).get("trainer") or {}
            _setup_wandb(_wandb_offline(parsed.get("logger")))
        return trainer


def build_cli(args: Sequence[str] | None = None, run: bool = True) -> DMLCLI:
    """Build (and with ``run=True`` execute) the CLI; ``args`` replaces ``sys.argv[1:]`` (used by tests)."""
    os.environ.setdefault("WANDB_SILENT", "true")
    from lightning_dml.rerank.cli_classes import reranker_fit_classes  # a re-ranker's config (configs/rerank/)

    rerank = reranker_fit_classes(sys.argv[1:] if args is None else args)
    return DMLCLI(
        *(rerank or (DMLModule, DMLDataModule)),
        subclass_mode_data=rerank is None,
        save_config_callback=SaveRunConfig,  # config.yaml in the run's own folders (lightning_dml/run_config.py)
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: Sequence[str] | None = None) -> None:
    """The ``lightning-dml`` command (``args`` replaces ``sys.argv[1:]``): :func:`lightning_dml.entry.main`, which
    the console script runs without importing this module first."""
    entry_main(args)


__all__ = [
    "COMMANDS",
    "DMLCLI",
    "TRAINER_DEFAULTS",
    "build_cli",
    "main",
    "quiet_dependency_warnings",
    "quiet_lightning_tips",
]
