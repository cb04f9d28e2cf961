// The consoles' own script: charts (uPlot) drawn from the JSON in their data-spec attribute, since the
// Content-Security-Policy allows no inline script; drawn again after htmx swaps new data in, and resized with their box. Also asks before
// submitting a form marked data-confirm.
(function () {
  "use strict";
  var COLORS = ["#2457c5", "#16794a", "#b42318", "#9a6700", "#7a3fc2", "#0e7c86", "#c2410c", "#5d6677"];
  var plots = [];

  function format(kind, v) {
    if (v == null) return "—";
    if (kind === "usd") return "$" + (Math.abs(v) >= 0.01 || v === 0 ? v.toFixed(2) : v.toExponential(1));
    if (kind === "ratio") return (100 * v).toFixed(0) + "%";
    if (kind === "ms") return v.toFixed(0) + " ms";
    return Math.abs(v) >= 100 ? v.toFixed(0) : String(Math.round(v * 100) / 100);
  }

  function draw(el) {
    if (typeof uPlot === "undefined") return;
    var spec = JSON.parse(el.dataset.spec);
    el.dataset.drawn = "1";
    el.textContent = "";
    if (!spec.data.length || !spec.data[0].length) {
      var empty = document.createElement("div");
      empty.className = "empty";
      empty.textContent = spec.empty || "No data yet.";
      el.appendChild(empty);
      return;
    }
    var series = [{}].concat(spec.series.map(function (s, i) {
      var one = {label: s.label, stroke: s.color || COLORS[i % COLORS.length], width: s.width || 2,
                 value: function (u, v) { return format(spec.y, v); }};
      if (s.dash) one.dash = [6, 4];
      if (s.bars) {
        one.paths = uPlot.paths.bars({size: [0.6, 40]});
        one.fill = (s.color || COLORS[i % COLORS.length]) + "99";
      }
      return one;
    }));
    var xs = spec.data[0];
    // The window the chart covers (a single sample would otherwise stretch the axis over years).
    var xrange = spec.xrange || (xs.length > 1 ? null : [xs[0] - 60, xs[0] + 60]);
    var opts = {
      width: Math.max(el.clientWidth, 240), height: spec.height || 220, series: series,
      scales: {x: xrange ? {time: spec.time !== false, range: xrange} : {time: spec.time !== false},
               y: {range: function (u, min, max) {
        return [Math.min(0, min), max > 0 ? max * 1.1 : 1];
      }}},
      axes: [{}, {size: 64, values: function (u, vals) { return vals.map(function (v) { return format(spec.y, v); }); }}],
    };
    plots.push(new uPlot(opts, spec.data, el));
  }

  function drawAll() {
    plots = plots.filter(function (p) {
      if (p.root.isConnected) return true;
      p.destroy();
      return false;
    });
    document.querySelectorAll("[data-spec]:not([data-drawn])").forEach(draw);
  }

  document.addEventListener("DOMContentLoaded", drawAll);
  document.addEventListener("htmx:afterSettle", drawAll);
  window.addEventListener("resize", function () {
    plots.forEach(function (p) {
      var box = p.root.parentNode;
      if (box) p.setSize({width: Math.max(box.clientWidth, 240), height: p.height});
    });
  });
  document.addEventListener("submit", function (e) {
    var message = e.target.dataset && e.target.dataset.confirm;
    if (message && !window.confirm(message)) e.preventDefault();
  });
})();
