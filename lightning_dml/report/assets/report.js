/* lightning-dml retrieval report. Plain JavaScript, no library, nothing fetched: the data are script files
   (data/summary.js, data/queries-NNNNN.js) that call DMLReport.summary(...) and DMLReport.page(n, ...), so the
   page works from file:// in every browser. Only the shown page of query rows is loaded. */
"use strict";
var DMLReport = (function () {
  var S = null;            // the summary
  var pages = {};          // loaded pages of query rows
  var requested = {};      // pages whose script was added
  var current = 0;         // the shown page
  var FLAG = {0: "irr", 1: "rel", 2: "ign"};
  var FLAG_TEXT = {0: "irrelevant", 1: "relevant", 2: "ignored (same sequence)"};
  var SVG = "http://www.w3.org/2000/svg";
  var classState = {key: 4, asc: true, page: 0, filter: "", rows: null};
  var CLASS_PAGE = 100;

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    for (var k in (attrs || {})) {
      if (k === "text") node.textContent = attrs[k];
      else if (k === "cls") node.className = attrs[k];
      else node.setAttribute(k, attrs[k]);
    }
    (children || []).forEach(function (c) { if (c) node.appendChild(c); });
    return node;
  }
  function svg(tag, attrs, text) {
    var node = document.createElementNS(SVG, tag);
    for (var k in (attrs || {})) node.setAttribute(k, attrs[k]);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  // every figure as the commands print it (lightning_dml/metrics_format.py): rates in percent with two decimals,
  // threshold@fmr (a score) with four
  function pct(v, digits) { return v === null || v === undefined ? "\u2013" : (100 * v).toFixed(digits === undefined ? 2 : digits); }
  function isRate(name) { return name.split("/").pop().indexOf("threshold@") !== 0; }
  function metricValue(name, v) { return v === null || v === undefined ? "\u2013" : isRate(name) ? pct(v, 2) : v.toFixed(4); }
  function score(v) { return v === null || v === undefined ? "" : Math.abs(v) < 1000 ? v.toFixed(3) : v.toExponential(2); }

  // ------------------------------------------------------------------------------------ thumbnails
  function tile(items, index, cls, caption, hover) {
    var it = items[String(index)] || ["?", "item " + index, null];
    var fig = el("figure", {cls: "tile " + cls, "data-index": String(index), title: hover + "\nlabel: " + it[0] + "\nfile: " + it[1]});
    if (it[2]) fig.appendChild(el("img", {src: it[2], alt: it[0], width: "70", height: "70", decoding: "async"}));
    else fig.appendChild(el("div", {cls: "noimg", text: it[0]}));
    fig.appendChild(el("figcaption", {text: caption}));
    return fig;
  }

  // ------------------------------------------------------------------------------------ summary sections
  function renderHeader() {
    document.title = S.title;
    document.getElementById("title").textContent = S.title;
    var c = S.counts, parts = [];
    for (var k in S.source) parts.push(k + ": " + S.source[k]);
    parts.push(c.items + " items, " + c.queries + " queries, gallery of " + c.gallery + ", " + c.classes +
               " query classes, " + S.metric + " similarity");
    document.getElementById("source").textContent = parts.join(" \u00b7 ");
  }

  function renderMetrics() {
    var table = el("table", {id: "metrics-values"});
    var scores = S.metrics.some(function (m) { return !isRate(m[0]); }) ? "; threshold@fmr: score" : "";
    table.appendChild(el("tr", {}, [el("th", {text: "metric"}), el("th", {text: "value (%" + scores + ")"})]));
    S.metrics.forEach(function (m) {
      table.appendChild(el("tr", {"data-metric": m[0]}, [el("td", {text: m[0]}), el("td", {text: metricValue(m[0], m[1]), title: String(m[1])})]));
    });
    document.getElementById("metrics-table").appendChild(table);
    if (S.categories) {  // per category of the queries: one row per category, one column per metric
      var cats = el("table", {id: "category-values"});
      cats.appendChild(el("tr", {}, [el("th", {text: "category"})].concat(S.categories.metrics.map(function (m) { return el("th", {text: m}); }))));
      S.categories.rows.forEach(function (r) {
        cats.appendChild(el("tr", {"data-category": r[0]}, [el("td", {text: r[0]})].concat(r.slice(1).map(function (v, i) {
          return el("td", {text: metricValue(S.categories.metrics[i], v), title: String(v)});
        }))));
      });
      document.getElementById("metrics-table").appendChild(cats);
    }
    // Recall@K curve, log2 K axis
    var W = 400, H = 240, L = 44, R = 20, T = 12, B = 34;
    var ks = S.curve.map(function (p) { return p[0]; });
    var lx = function (k) { return Math.log2(k); };
    var x0 = lx(ks[0]), x1 = Math.max(lx(ks[ks.length - 1]), x0 + 1);
    var X = function (k) { return L + (lx(k) - x0) / (x1 - x0) * (W - L - R); };
    var Y = function (v) { return T + (1 - v) * (H - T - B); };
    var s = svg("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img"});
    s.appendChild(svg("title", {}, "Recall@K"));
    for (var g = 0; g <= 4; g++) {
      var v = g / 4;
      s.appendChild(svg("line", {x1: L, x2: W - R, y1: Y(v), y2: Y(v), "class": "grid"}));
      s.appendChild(svg("text", {x: L - 6, y: Y(v) + 4, "text-anchor": "end"}, String(100 * v)));
    }
    var lastTick = -1e9, kmax = ks[ks.length - 1];
    ks.forEach(function (k) {  // powers of two, and the largest K where it does not overlap them
      var room = k === kmax ? X(k) - lastTick >= 34 : X(kmax) - X(k) >= 34 || (k & (k - 1)) === 0 && k === kmax;
      if (((k & (k - 1)) === 0 || k === kmax) && (room || k === 1)) {
        s.appendChild(svg("text", {x: X(k), y: H - B + 14, "text-anchor": "middle"}, String(k)));
        lastTick = X(k);
      }
    });
    s.appendChild(svg("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle"}, "K (log scale)"));
    s.appendChild(svg("text", {x: 12, y: T + (H - T - B) / 2, transform: "rotate(-90 12 " + (T + (H - T - B) / 2) + ")",
                              "text-anchor": "middle"}, "Recall@K (%)"));
    s.appendChild(svg("polyline", {"class": "curve", points: S.curve.map(function (p) { return X(p[0]) + "," + Y(p[1]); }).join(" ")}));
    S.curve.forEach(function (p) {
      var dot = svg("circle", {"class": "dot", cx: X(p[0]), cy: Y(p[1]), r: 3});
      dot.appendChild(svg("title", {}, "Recall@" + p[0] + " = " + pct(p[1], 2) + "%"));
      s.appendChild(dot);
    });
    s.appendChild(svg("line", {x1: L, x2: L, y1: T, y2: H - B, "class": "axis"}));
    s.appendChild(svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, "class": "axis"}));
    document.getElementById("recall-curve").appendChild(s);
    document.getElementById("recall-curve").appendChild(el("figcaption", {cls: "muted", text: "Recall@K, from K = 1 to the whole gallery"}));
  }

  function renderHistogram() {
    var host = document.getElementById("histogram");
    var h = S.histogram;
    if (!h) { host.appendChild(el("p", {cls: "muted", text: "not computed (no pair histogram in these results)"})); return; }
    var n = h.positive.length, first = n, last = -1, i;
    var sp = h.positive.reduce(function (a, b) { return a + b; }, 0), sn = h.negative.reduce(function (a, b) { return a + b; }, 0);
    for (i = 0; i < n; i++) if (h.positive[i] || h.negative[i]) { first = Math.min(first, i); last = i; }
    if (last < 0) { host.appendChild(el("p", {cls: "muted", text: "no pair"})); return; }
    var dp = h.positive.map(function (c) { return sp ? c / sp : 0; }), dn = h.negative.map(function (c) { return sn ? c / sn : 0; });
    var top = Math.max.apply(null, dp.concat(dn)) || 1;
    var W = 480, H = 240, L = 44, R = 28, T = 12, B = 34, bw = (W - L - R) / (last - first + 1);
    var Y = function (v) { return T + (1 - v / top) * (H - T - B); };
    var s = svg("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img"});
    s.appendChild(svg("title", {}, "Scores of positive and negative pairs"));
    for (i = first; i <= last; i++) {
      var x = L + (i - first) * bw, label = "[" + score(h.edges[i]) + ", " + score(h.edges[i + 1]) + "): ";
      var rn = svg("rect", {"class": "neg", x: x, width: Math.max(bw - 1, 1), y: Y(dn[i]), height: H - B - Y(dn[i])});
      rn.appendChild(svg("title", {}, label + h.negative[i] + " negative pairs"));
      var rp = svg("rect", {"class": "pos", x: x, width: Math.max(bw - 1, 1), y: Y(dp[i]), height: H - B - Y(dp[i])});
      rp.appendChild(svg("title", {}, label + h.positive[i] + " positive pairs"));
      s.appendChild(rn); s.appendChild(rp);
    }
    [first, Math.round((first + last + 1) / 2), last + 1].forEach(function (j) {
      s.appendChild(svg("text", {x: L + (j - first) * bw, y: H - B + 14, "text-anchor": "middle"}, score(h.edges[j])));
    });
    s.appendChild(svg("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle"},
                      (S.metric === "cosine" ? "cosine similarity" : "negative squared distance")));
    s.appendChild(svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, "class": "axis"}));
    s.appendChild(svg("line", {x1: L, x2: L, y1: T, y2: H - B, "class": "axis"}));
    s.appendChild(svg("text", {x: 12, y: T + (H - T - B) / 2, transform: "rotate(-90 12 " + (T + (H - T - B) / 2) + ")",
                              "text-anchor": "middle"}, "share of pairs"));
    var op = S.operating_point;
    if (op) {  // the match threshold (a pair matches when its score > threshold), where the bins show it
      var lo = h.edges[first], hi = h.edges[last + 1];
      var xt = L + Math.min(Math.max((op.threshold - lo) / ((hi - lo) || 1), 0), 1) * (W - L - R);
      var line = svg("line", {x1: xt, x2: xt, y1: T, y2: H - B, "class": "op"});
      line.appendChild(svg("title", {}, opText(op)));
      s.appendChild(line);
      s.appendChild(svg("text", {x: Math.min(xt + 3, W - R - 40), y: T + 10, "class": "opl"}, "threshold " + score(op.threshold)));
    }
    host.appendChild(s);
    host.appendChild(el("figcaption", {}, [
      el("span", {cls: "key rel"}), document.createTextNode(" " + sp + " positive "),
      el("span", {cls: "key irr"}), document.createTextNode(" " + sn + " negative pairs (each scaled to its total)")]));
    if (op) host.appendChild(el("figcaption", {cls: "muted", text: opText(op)}));
  }

  function opText(op) {
    return "operating point: threshold " + op.threshold + " (match: score > threshold) at target FMR " + op.target +
      ": FMR " + pct(op.fmr, 4) + "%, FNMR " + pct(op.fnmr, 2) + "%";
  }

  function renderDET() {  // FNMR against FMR, both on log axes, at the histograms' bin edges
    var host = document.getElementById("det");
    var op = S.operating_point;
    var pts = (S.det || []).filter(function (p) { return p[0] > 0 && p[1] > 0; });
    if (op && op.fmr > 0 && op.fnmr > 0) pts = pts.concat([[op.fmr, op.fnmr]]);
    if (!pts.length) { host.appendChild(el("p", {cls: "muted", text: "DET curve: not computed (no pair histogram, or no error at any bin edge)"})); return; }
    var lo = Math.floor(Math.log10(Math.min.apply(null, pts.map(function (p) { return Math.min(p[0], p[1]); }))));
    lo = Math.min(lo, -1);
    var W = 300, H = 240, L = 44, R = 12, T = 12, B = 34;
    var X = function (v) { return L + (Math.log10(v) - lo) / -lo * (W - L - R); };
    var Y = function (v) { return T + (1 - (Math.log10(v) - lo) / -lo) * (H - T - B); };
    var s = svg("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img"});
    s.appendChild(svg("title", {}, "DET curve"));
    for (var e = lo; e <= 0; e++) {
      var v = Math.pow(10, e), t = e === 0 ? "1" : "1e" + e;
      s.appendChild(svg("line", {x1: X(v), x2: X(v), y1: T, y2: H - B, "class": "grid"}));
      s.appendChild(svg("line", {x1: L, x2: W - R, y1: Y(v), y2: Y(v), "class": "grid"}));
      s.appendChild(svg("text", {x: X(v), y: H - B + 14, "text-anchor": "middle"}, t));
      s.appendChild(svg("text", {x: L - 4, y: Y(v) + 4, "text-anchor": "end"}, t));
    }
    var curve = (S.det || []).filter(function (p) { return p[0] > 0 && p[1] > 0; });
    s.appendChild(svg("polyline", {"class": "curve", points: curve.map(function (p) { return X(p[0]) + "," + Y(p[1]); }).join(" ")}));
    if (op && op.fmr > 0 && op.fnmr > 0) {
      var dot = svg("circle", {"class": "opdot", cx: X(op.fmr), cy: Y(op.fnmr), r: 5});
      dot.appendChild(svg("title", {}, opText(op)));
      s.appendChild(dot);
    }
    s.appendChild(svg("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle"}, "false match rate (log)"));
    s.appendChild(svg("text", {x: 12, y: T + (H - T - B) / 2, transform: "rotate(-90 12 " + (T + (H - T - B) / 2) + ")",
                              "text-anchor": "middle"}, "false non-match rate (log)"));
    s.appendChild(svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, "class": "axis"}));
    s.appendChild(svg("line", {x1: L, x2: L, y1: T, y2: H - B, "class": "axis"}));
    host.appendChild(s);
    host.appendChild(el("figcaption", {cls: "muted", text: "DET: at each histogram bin edge" + (op ? "; dot: the operating point" : "")}));
  }

  function renderConfused() {
    var host = document.getElementById("confused-pairs");
    if (!S.confused.length) { host.appendChild(el("p", {cls: "muted", text: "no class is ranked ahead of a query's positives"})); return; }
    S.confused.forEach(function (p) {
      var ex = el("div", {cls: "examples"});
      p.examples.forEach(function (e) {
        ex.appendChild(el("span", {cls: "ex"}, [tile(S.items, e[0], "query", "query", "query " + e[0]),
                                               tile(S.items, e[1], "irr", score(e[2]), "ranked ahead of the positives, score " + score(e[2]))]));
      });
      host.appendChild(el("div", {cls: "pair"}, [
        el("div", {cls: "what"}, [el("b", {text: p.an + " \u2192 " + p.bn}),
                                  el("div", {cls: "muted", text: p.count + " times a " + p.bn + " ranked ahead of a " + p.an + "'s first positive"})]),
        ex]));
    });
  }

  // ------------------------------------------------------------------------------------ per-class table
  var CLASS_COLUMNS = [["class", "num"], ["name", "name"], ["queries", "num"], ["items", "num"], ["recall@1 (%)", "pct"], ["map@r (%)", "pct"]];
  function renderClasses() {
    var rows = S.per_class.filter(function (r) { return r[1].toLowerCase().indexOf(classState.filter) >= 0; });
    var k = classState.key, dir = classState.asc ? 1 : -1;
    rows.sort(function (a, b) {
      var x = a[k], y = b[k];
      if (x === y) return a[0] - b[0];
      if (x === null) return 1;
      if (y === null) return -1;
      return (x < y ? -1 : 1) * dir;
    });
    var pagesN = Math.max(1, Math.ceil(rows.length / CLASS_PAGE));
    classState.page = Math.min(classState.page, pagesN - 1);
    var table = document.getElementById("class-table");
    table.textContent = "";
    var head = el("tr");
    CLASS_COLUMNS.forEach(function (c, i) {
      var th = el("th", {text: c[0], "data-col": String(i), cls: (c[1] === "name" ? "name " : "") + (i === k ? (classState.asc ? "asc" : "desc") : "")});
      th.addEventListener("click", function () {
        if (classState.key === i) classState.asc = !classState.asc; else { classState.key = i; classState.asc = true; }  // ascending first: the worst classes on top
        renderClasses();
      });
      head.appendChild(th);
    });
    table.appendChild(head);
    rows.slice(classState.page * CLASS_PAGE, (classState.page + 1) * CLASS_PAGE).forEach(function (r) {
      table.appendChild(el("tr", {"data-class": String(r[0])}, CLASS_COLUMNS.map(function (c, i) {
        return el("td", {cls: c[1] === "name" ? "name" : "", text: c[1] === "pct" ? pct(r[i]) : String(r[i])});
      })));
    });
    document.getElementById("class-count").textContent = rows.length + " of " + S.per_class.length + " classes";
    pager(document.getElementById("class-pager"), classState.page, pagesN, function (p) { classState.page = p; renderClasses(); });
  }

  // ------------------------------------------------------------------------------------ query rows
  function pager(host, page, count, go) {
    host.textContent = "";
    if (count <= 1) return;
    var b = function (text, p, off) {
      var btn = el("button", {text: text, type: "button"});
      btn.disabled = off;
      btn.addEventListener("click", function () { go(p); });
      return btn;
    };
    var input = el("input", {type: "number", min: "1", max: String(count), value: String(page + 1), "aria-label": "page"});
    input.addEventListener("change", function () { var p = parseInt(input.value, 10); if (p >= 1 && p <= count) go(p - 1); });
    [b("\u00ab", 0, page === 0), b("\u2039", page - 1, page === 0), document.createTextNode(" page "), input,
     document.createTextNode(" of " + count + " "), b("\u203a", page + 1, page >= count - 1), b("\u00bb", count - 1, page >= count - 1)
    ].forEach(function (c) { host.appendChild(c); });
  }

  function showPage(n) {
    current = n;
    pager(document.getElementById("query-pager"), n, S.pages, showPage);
    var host = document.getElementById("query-rows");
    if (!pages[n]) {
      host.textContent = "loading page " + (n + 1) + " \u2026";
      if (!requested[n]) {
        requested[n] = true;
        var script = el("script", {src: "data/queries-" + String(n).padStart(5, "0") + ".js"});
        script.onerror = function () { host.textContent = ""; host.appendChild(el("p", {cls: "error", text: "data/queries-" + String(n).padStart(5, "0") + ".js is missing"})); };
        document.head.appendChild(script);
      }
      return;
    }
    host.textContent = "";
    var data = pages[n];
    if (!data.rows.length) { host.appendChild(el("p", {cls: "muted", text: "no query to show (--queries 0, or no query has a relevant item)"})); return; }
    data.rows.forEach(function (r, i) {
      var rank = n * S.per_page + i + 1;
      var info = el("div", {cls: "qinfo"}, [el("b", {text: "#" + rank}), el("div", {text: "AP " + pct(r.ap)}),
        el("div", {text: "R = " + r.r}), el("div", {text: r.first < 0 ? "no relevant item" : "1st relevant: rank " + (r.first + 1)})]);
      var row = el("div", {cls: "qrow", "data-query": String(r.q)}, [info, tile(data.items, r.q, "query", data.items[String(r.q)] ? data.items[String(r.q)][0] : "", "query " + r.q + " (AP " + pct(r.ap) + "%, R = " + r.r + ")"), el("div", {cls: "sep"})]);
      r.hits.forEach(function (h) {
        var t = tile(data.items, h[0], FLAG[h[2]], (h[3] ? h[3] + ": " : "") + score(h[1]),
                     (h[3] ? "rank " + h[3] : "not ranked") + ", " + FLAG_TEXT[h[2]] + ", score " + score(h[1]));
        t.setAttribute("data-flag", String(h[2]));
        row.appendChild(t);
      });
      host.appendChild(row);
    });
  }

  // ------------------------------------------------------------------------------------ entry points
  function render() {
    renderHeader();
    renderMetrics();
    renderHistogram();
    renderDET();
    renderConfused();
    var filter = document.getElementById("class-filter");
    filter.addEventListener("input", function () { classState.filter = filter.value.toLowerCase(); classState.page = 0; renderClasses(); });
    classState.key = 0; classState.asc = true;
    renderClasses();
    showPage(0);
  }

  function summary(data) {
    S = data;
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", render);
    else render();
  }

  function page(n, data) {
    pages[n] = data;
    if (S && n === current && document.readyState !== "loading") showPage(n);
  }

  return {summary: summary, page: page, show: showPage};
})();
