"""The charting code the HTML report inlines: hand-written JavaScript that draws the timeline as SVG
(no library, no network). Kept in a Python module so that it ships with the package."""

CHART_JS = r"""// memfit's memory timeline: draws the samples of the JSON script #memfit-data as SVG into #memfit-chart,
// and those of each [data-rank-timeline] box (another group of ranks of a multi-GPU run) into its own svg.
// Self-contained (no library, no network): stacked areas by category, the reserved line, the GPU's
// lines, the phases as bands, the peak and the OOM marked; hovering lists the largest live storages.
(function () {
  "use strict";
  function draw(D, svg, wrap, tip, offScale) {
    var NS = svg.namespaceURI;  // the SVG namespace, as the HTML parser gave it to the inline <svg>
    var W = 1100, H = 460, M = {l: 80, r: 24, t: 30, b: 44};
    var PW = W - M.l - M.r, PH = H - M.t - M.b;
    var S = D.samples;
    var xmax = Math.max(D.num_events - 1, 1);
    // the y range holds the samples and every line within OFF_SCALE times them (a far larger GPU is
    // named at the top edge instead of squashing the run to the bottom)
    var OFF_SCALE = 2;
    var ydata = 1;
    S.forEach(function (s) { ydata = Math.max(ydata, s.allocated_bytes, s.reserved_bytes); });
    var REQ = D.oom !== null && D.oom.index !== null ? D.oom.request : null;  // the failing request
    if (REQ !== null) ydata = Math.max(ydata, REQ.total_bytes);
    var ymax = ydata;
    D.lines.forEach(function (ln) { if (ln.bytes <= OFF_SCALE * ydata) ymax = Math.max(ymax, ln.bytes); });
    ymax *= 1.06;

    function X(i) { return M.l + PW * i / xmax; }
    function Y(b) { return M.t + PH - PH * b / ymax; }
    function el(name, attrs, parent) {
      var e = document.createElementNS(NS, name);
      for (var k in attrs) { if (Object.prototype.hasOwnProperty.call(attrs, k)) e.setAttribute(k, attrs[k]); }
      (parent || svg).appendChild(e);
      return e;
    }
    function text(str, attrs, parent) { var t = el("text", attrs, parent); t.textContent = str; return t; }
    function fmt(b) {
      var units = ["B", "KiB", "MiB", "GiB", "TiB"], u = 0, v = b;
      while (Math.abs(v) >= 1024 && u < units.length - 1) { v /= 1024; u += 1; }
      return (u === 0 ? String(v) : v.toFixed(2)) + " " + units[u];
    }
    function phaseLabel(phase, step) { return step === null ? phase : phase + " " + step; }

    svg.setAttribute("viewBox", "0 0 " + W + " " + H);

    // phases as bands
    var bands = el("g", {"class": "bands"});
    D.spans.forEach(function (sp) {
      var x0 = X(sp.start), x1 = X(Math.min(sp.end + 1, xmax));
      var r = el("rect", {x: x0, y: M.t, width: Math.max(x1 - x0, 0.5), height: PH,
                          fill: D.phase_colors[sp.phase] || "#f5f5f5", "data-phase": sp.phase,
                          "data-step": sp.step === null ? "" : sp.step}, bands);
      text(phaseLabel(sp.phase, sp.step), {}, el("title", {}, r));
      if (x1 - x0 > 46) {
        text(phaseLabel(sp.phase, sp.step), {x: (x0 + x1) / 2, y: M.t - 8, "text-anchor": "middle",
                                             "class": "band-label"}, bands);
      }
    });

    // y axis: binary units, about six gridlines
    var unit = ymax >= 2 * Math.pow(1024, 3) ? Math.pow(1024, 3) : (ymax >= 2 * Math.pow(1024, 2) ? Math.pow(1024, 2) : 1024);
    var raw = ymax / unit / 6, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var stepU = [1, 2, 2.5, 5, 10].map(function (f) { return f * mag; }).filter(function (s) { return s >= raw; })[0];
    var axis = el("g", {"class": "axis"});
    for (var v = 0; v <= ymax / unit + 1e-9; v += stepU) {
      var yy = Y(v * unit);
      el("line", {x1: M.l, x2: W - M.r, y1: yy, y2: yy, "class": "grid"}, axis);
      text(fmt(v * unit).replace(".00", ""), {x: M.l - 6, y: yy + 4, "text-anchor": "end"}, axis);
    }
    el("line", {x1: M.l, x2: W - M.r, y1: M.t + PH, y2: M.t + PH, "class": "frame"}, axis);
    el("line", {x1: M.l, x2: M.l, y1: M.t, y2: M.t + PH, "class": "frame"}, axis);
    text("trace event (program order of the simulated run: " + D.num_events + " allocations and frees)",
         {x: M.l + PW / 2, y: H - 10, "text-anchor": "middle"}, axis);

    // allocated, stacked by category
    var cum = S.map(function () { return 0; });
    var areas = el("g", {"class": "areas"});
    D.categories.forEach(function (cat) {
      var up = [], down = [];
      S.forEach(function (s, k) {
        var lo = cum[k], hi = lo + (s.by_category[cat] || 0);
        up.push(X(s.index).toFixed(2) + "," + Y(hi).toFixed(2));
        down.push(X(s.index).toFixed(2) + "," + Y(lo).toFixed(2));
        cum[k] = hi;
      });
      down.reverse();
      var p = el("path", {d: "M" + up.join("L") + "L" + down.join("L") + "Z", fill: D.colors[cat],
                          "fill-opacity": 0.88, "class": "series", "data-category": cat}, areas);
      text(D.labels[cat], {}, el("title", {}, p));
    });

    // reserved
    el("path", {d: "M" + S.map(function (s) { return X(s.index).toFixed(2) + "," + Y(s.reserved_bytes).toFixed(2); }).join("L"),
                "class": "reserved", "data-series": "reserved"});

    // the peak, as the chart draws it
    var pk = 0;
    S.forEach(function (s, k) { if (s.allocated_bytes > S[pk].allocated_bytes) pk = k; });
    var peak = S[pk];

    // the GPU's lines, labelled at the end away from the peak
    var labelRight = X(peak.index) < M.l + PW * 0.5;
    var lastLabelY = -1e9;
    D.lines.slice().sort(function (a, b) { return b.bytes - a.bytes; }).forEach(function (ln) {
      if (ln.bytes > ymax) {  // off the scale: named under the chart
        var p = document.createElement("span");
        p.setAttribute("data-line", ln.id);
        p.setAttribute("data-bytes", ln.bytes);
        p.textContent = "\u2191 " + ln.label + ": " + fmt(ln.bytes) + ", above the chart's scale. ";
        offScale.appendChild(p);
        return;
      }
      var yy = Y(ln.bytes);
      el("line", {x1: M.l, x2: W - M.r, y1: yy, y2: yy, "class": "hline " + ln.id, "data-line": ln.id, "data-bytes": ln.bytes});
      var ly = yy - 5 - lastLabelY < 13 ? yy + 13 : yy - 5;  // below its line when the one above is close
      lastLabelY = ly;
      text(ln.label + ": " + fmt(ln.bytes), {x: labelRight ? W - M.r - 4 : M.l + 4, y: ly,
                                             "text-anchor": labelRight ? "end" : "start", "class": "hline-label"});
    });

    svg.setAttribute("data-peak-allocated-bytes", peak.allocated_bytes);
    el("circle", {cx: X(peak.index), cy: Y(peak.allocated_bytes), r: 5, "class": "peak", "data-marker": "peak",
                  "data-bytes": peak.allocated_bytes, "data-index": peak.index});
    var peakWord = D.oom !== null && D.oom.index !== null ? "highest before the OOM " : "peak ";
    // with the OOM's request drawn above it, the peak's label goes under its point (the OOM's labels are above)
    text(peakWord + fmt(peak.allocated_bytes) + " (" + phaseLabel(peak.phase, peak.step) + ")",
         {x: X(peak.index) + (X(peak.index) > M.l + PW * 0.7 ? -8 : 8), y: Y(peak.allocated_bytes) + (REQ !== null ? 18 : -8),
          "text-anchor": X(peak.index) > M.l + PW * 0.7 ? "end" : "start", "class": "peak-label"});

    if (D.oom !== null && D.oom.index !== null) {
      var xo = X(D.oom.index);
      el("line", {x1: xo, x2: xo, y1: M.t, y2: M.t + PH, "class": "oom", "data-marker": "oom", "data-index": D.oom.index});
      text("out of memory: " + phaseLabel(D.oom.phase, D.oom.step), {x: xo - 6, y: M.t + 14, "text-anchor": "end", "class": "oom-label"});
      if (REQ !== null) {  // the request that fails, stacked on what was allocated then: the point the run cannot reach
        var yTop = Y(REQ.total_bytes), yBase = Y(REQ.allocated_bytes);
        var bar = el("rect", {x: xo - 7, y: yTop, width: 14, height: Math.max(yBase - yTop, 1), "class": "oom-request",
                              "data-marker": "oom-request", "data-bytes": REQ.total_bytes,
                              "data-request-bytes": REQ.size_bytes, "data-index": D.oom.index});
        text("failed request " + fmt(REQ.size_bytes) + " of " + (D.labels[REQ.category] || REQ.category), {}, el("title", {}, bar));
        el("circle", {cx: xo, cy: yTop, r: 5, "class": "oom-point", "data-marker": "oom-point", "data-bytes": REQ.total_bytes});
        text("needs " + fmt(REQ.total_bytes) + ": " + fmt(REQ.allocated_bytes) + " allocated + " + fmt(REQ.size_bytes) +
             " requested", {x: xo - 6, y: M.t + 29, "text-anchor": "end", "class": "oom-label"});
      }
    }

    // hover: the nearest sample, its categories and its largest live storages
    var cursor = el("line", {x1: 0, x2: 0, y1: M.t, y2: M.t + PH, "class": "cursor", visibility: "hidden"});
    var dot = el("circle", {cx: 0, cy: 0, r: 4, "class": "cursor-dot", visibility: "hidden"});
    var overlay = el("rect", {x: M.l, y: M.t, width: PW, height: PH, fill: "transparent", "data-role": "hover"});

    // the sample under the mouse: of those within SNAP_PX of it, the highest (several samples share a
    // pixel when the run is long, and the one to show there is its highest, the peak among them)
    var SNAP_PX = 1.5;
    function nearest(idx) {
      var lo = 0, hi = S.length - 1;
      while (hi - lo > 1) { var mid = (lo + hi) >> 1; if (S[mid].index <= idx) lo = mid; else hi = mid; }
      var k = Math.abs(S[lo].index - idx) <= Math.abs(S[hi].index - idx) ? lo : hi;
      var x = X(idx), best = k;
      for (var j = k - 1; j >= 0 && x - X(S[j].index) <= SNAP_PX; j--) { if (S[j].allocated_bytes > S[best].allocated_bytes) best = j; }
      for (var j2 = k + 1; j2 < S.length && X(S[j2].index) - x <= SNAP_PX; j2++) { if (S[j2].allocated_bytes > S[best].allocated_bytes) best = j2; }
      if (REQ !== null && Math.abs(X(S[S.length - 1].index) - x) <= SNAP_PX) return S.length - 1;  // the OOM itself
      return best;
    }
    function cell(row, str, cls) { var td = document.createElement("td"); td.textContent = str; if (cls) td.className = cls; row.appendChild(td); return td; }
    function show(k, evt) {
      var s = S[k];
      cursor.setAttribute("x1", X(s.index)); cursor.setAttribute("x2", X(s.index));
      cursor.setAttribute("visibility", "visible");
      dot.setAttribute("cx", X(s.index)); dot.setAttribute("cy", Y(s.allocated_bytes));
      dot.setAttribute("visibility", "visible");
      tip.textContent = "";
      tip.setAttribute("data-index", s.index);
      tip.setAttribute("data-allocated-bytes", s.allocated_bytes);
      var head = document.createElement("div");
      head.className = "tt-head";
      head.textContent = "event " + s.index + " \u00b7 " + phaseLabel(s.phase, s.step);
      tip.appendChild(head);
      var tot = document.createElement("div");
      tot.textContent = "allocated " + fmt(s.allocated_bytes) + " \u00b7 reserved " + fmt(s.reserved_bytes);
      tip.appendChild(tot);
      var cats = document.createElement("table");
      cats.className = "tt-cats";
      D.categories.forEach(function (cat) {
        var b = s.by_category[cat] || 0;
        if (!b) return;
        var tr = document.createElement("tr");
        var sw = cell(tr, "\u25a0");
        sw.style.color = D.colors[cat];
        cell(tr, D.labels[cat]);
        cell(tr, fmt(b), "num");
        cats.appendChild(tr);
      });
      tip.appendChild(cats);
      var tt = document.createElement("table");
      tt.className = "tt-tensors";
      var hr = document.createElement("tr");
      ["largest live", "category", "module", "shape", "dtype", "allocated in"].forEach(function (h) {
        var th = document.createElement("th"); th.textContent = h; hr.appendChild(th);
      });
      tt.appendChild(hr);
      function row(t, cls, size) {
        var tr = document.createElement("tr");
        tr.className = cls;
        tr.setAttribute("data-category", t.category);
        cell(tr, size, "num");
        cell(tr, D.labels[t.category] || t.category);
        cell(tr, t.module || "\u2014");
        cell(tr, t.shape === null ? "\u2014" : "(" + t.shape.join(", ") + ")");
        cell(tr, t.dtype === null ? "\u2014" : t.dtype);
        cell(tr, t.phase);
        tt.appendChild(tr);
        return tr;
      }
      if (REQ !== null && s.index === D.oom.index) {  // the OOM: the request not granted, first
        row(REQ, "request", "requested " + fmt(REQ.size_bytes) + " (not granted" + (REQ.tried_bytes !== null &&
            REQ.tried_bytes !== REQ.size_bytes ? "; the allocator asked the GPU for a " + fmt(REQ.tried_bytes) +
            " segment" : "") + ")");
        tot.textContent += " \u00b7 out of memory: would need " + fmt(REQ.total_bytes);
      }
      s.top.forEach(function (id) {
        row(D.tensors[id], "tensor", fmt(D.tensors[id].size_bytes)).setAttribute("data-tensor-id", id);
      });
      tip.appendChild(tt);
      tip.style.display = "block";
      var box = wrap.getBoundingClientRect();
      var left = evt.clientX - box.left + 16, top = evt.clientY - box.top + 16;
      if (left + tip.offsetWidth > box.width) left = Math.max(0, evt.clientX - box.left - tip.offsetWidth - 16);
      if (top + tip.offsetHeight > box.height) top = Math.max(0, evt.clientY - box.top - tip.offsetHeight - 16);
      tip.style.left = left + "px";
      tip.style.top = top + "px";
    }
    function hide() {
      tip.style.display = "none";
      cursor.setAttribute("visibility", "hidden");
      dot.setAttribute("visibility", "hidden");
    }
    overlay.addEventListener("mousemove", function (evt) {
      var pt = svg.createSVGPoint();
      pt.x = evt.clientX; pt.y = evt.clientY;
      var p = pt.matrixTransform(svg.getScreenCTM().inverse());
      show(nearest((p.x - M.l) / PW * xmax), evt);
    });
    overlay.addEventListener("mouseleave", hide);
  }
  draw(JSON.parse(document.getElementById("memfit-data").textContent), document.getElementById("memfit-chart"),
       document.getElementById("memfit-chart-wrap"), document.getElementById("memfit-tooltip"),
       document.getElementById("memfit-off-scale"));
  Array.prototype.forEach.call(document.querySelectorAll("[data-rank-timeline]"), function (box) {
    draw(JSON.parse(box.querySelector("script[type='application/json']").textContent), box.querySelector("svg"),
         box.querySelector(".chart-wrap"), box.querySelector(".tooltip"), box.querySelector(".off-scale"));
  });
  document.body.setAttribute("data-chart", "ready");
})();
"""
