/* moee specialization report: the interactive token view (own code, Apache-2.0 like the project).
 *
 * Every element with class "token-view" names, in data-source, a <script type="application/json">
 * block: {n_layers, n_experts, top_k, layer, scale, texts: [{label, tokens: [[text, selected, dense,
 * predicted]]}]} with selected[l] the experts of layer l (highest probability first), dense[l] its
 * probabilities times `scale` and predicted the model's next token (or null).
 * Corpus text only ever reaches the page through textContent, never as markup.
 */
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function colour(expert, n, light) {
    var hue = (expert * 137.508) % 360; // golden-angle spacing: neighbouring ids far apart
    var band = Math.floor(expert / Math.max(1, Math.ceil(n / 3))) % 3;
    var l = light ? 82 - 8 * band : 42;
    return "hsl(" + hue.toFixed(1) + ", 70%, " + l + "%)";
  }

  function visible(s) {
    // whitespace-only tokens would be invisible in the panel header
    return JSON.stringify(s);
  }

  function bars(dense, selected, scale, n) {
    var bw = Math.max(3, Math.min(20, Math.floor(256 / n)));
    var h = 30;
    var svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("width", String(bw * n));
    svg.setAttribute("height", String(h));
    svg.setAttribute("class", "tv-bars");
    var max = 0;
    for (var e = 0; e < n; e++) max = Math.max(max, dense[e]);
    for (e = 0; e < n; e++) {
      var r = document.createElementNS(SVG, "rect");
      var bh = max > 0 ? Math.max(1, (dense[e] / max) * (h - 1)) : 1;
      r.setAttribute("x", String(e * bw));
      r.setAttribute("y", String(h - bh));
      r.setAttribute("width", String(Math.max(1, bw - 1)));
      r.setAttribute("height", bh.toFixed(1));
      r.setAttribute("fill", selected.indexOf(e) >= 0 ? colour(e, n, false) : "#b8bec9");
      var t = document.createElementNS(SVG, "title");
      t.textContent = "E" + e + ": " + (dense[e] / scale).toFixed(3);
      r.appendChild(t);
      svg.appendChild(r);
    }
    return svg;
  }

  function init(root) {
    var source = document.getElementById(root.getAttribute("data-source"));
    var data = JSON.parse(source.textContent);
    var L = data.n_layers, E = data.n_experts, scale = data.scale;
    var tokens = [];
    var layer = data.layer, filter = -1, pinned = -1, shown = -1;

    var controls = el("div", "tv-controls");
    var layerLabel = el("label", "", "Layer ");
    var layerSel = el("select", "tv-layer");
    for (var l = 0; l < L; l++) {
      var o = el("option", "", "MoE layer " + l);
      o.value = String(l);
      layerSel.appendChild(o);
    }
    layerSel.value = String(layer);
    layerLabel.appendChild(layerSel);
    var filterLabel = el("label", "", "Highlight expert ");
    var filterSel = el("select", "tv-filter");
    var all = el("option", "", "none");
    all.value = "-1";
    filterSel.appendChild(all);
    for (var e = 0; e < E; e++) {
      var oe = el("option", "", "E" + e);
      oe.value = String(e);
      filterSel.appendChild(oe);
    }
    filterLabel.appendChild(filterSel);
    var count = el("span", "tv-count");
    controls.appendChild(layerLabel);
    controls.appendChild(filterLabel);
    controls.appendChild(count);
    controls.appendChild(el("span", "tv-hint", "hover a token for its routing in every layer; click to pin it"));
    var legend = el("div", "tv-legend");
    for (e = 0; e < E; e++) {
      var chip = el("span", "", "E" + e);
      chip.setAttribute("data-expert", String(e));
      legend.appendChild(chip);
    }

    var body = el("div", "tv-body");
    var textsBox = el("div", "tv-texts");
    var panel = el("div", "tv-panel");
    panel.setAttribute("aria-live", "polite");
    panel.appendChild(el("div", "tv-head", "hover a token"));
    data.texts.forEach(function (text) {
      var block = el("div", "tv-text");
      block.appendChild(el("div", "tv-label", text.label));
      var line = el("div", "tv-tokens");
      text.tokens.forEach(function (tok) {
        // a line break shows a mark (CSS ::before, so the text itself stays the token's)
        var span = el("span", tok[0].indexOf("\n") >= 0 ? "tok nl" : "tok", tok[0]);
        span.setAttribute("data-token", String(tokens.length));
        tokens.push({ text: tok[0], selected: tok[1], dense: tok[2], predicted: tok[3], span: span });
        line.appendChild(span);
      });
      block.appendChild(line);
      textsBox.appendChild(block);
    });
    body.appendChild(textsBox);
    body.appendChild(panel);
    root.appendChild(controls);
    root.appendChild(legend);
    root.appendChild(body);

    function paint() {
      var hits = 0;
      tokens.forEach(function (t) {
        var sel = t.selected[layer];
        t.span.style.backgroundColor = colour(sel[0], E, true);
        var hit = filter >= 0 && sel.indexOf(filter) >= 0;
        if (hit) hits++;
        t.span.classList.toggle("hit", hit);
        t.span.classList.toggle("dim", filter >= 0 && !hit);
      });
      Array.prototype.forEach.call(legend.children, function (chip) {
        var ex = Number(chip.getAttribute("data-expert"));
        chip.style.backgroundColor = colour(ex, E, true);
        chip.style.outline = ex === filter ? "2px solid #111" : "";
      });
      count.textContent = filter >= 0 ? "E" + filter + " is in the top-" + data.top_k + " of " + hits + " of " + tokens.length + " tokens in layer " + layer : "";
      if (shown >= 0) show(shown);
    }

    function show(i) {
      var t = tokens[i];
      if (shown >= 0 && tokens[shown]) tokens[shown].span.classList.remove("active");
      shown = i;
      t.span.classList.add("active");
      panel.textContent = "";
      panel.appendChild(el("div", "tv-head", "token " + i + ": " + visible(t.text) + (pinned === i ? " (pinned)" : "")));
      if (t.predicted !== null && t.predicted !== undefined) {
        panel.appendChild(el("div", "tv-pred", "predicted next token: " + visible(t.predicted)));
      }
      for (var l = 0; l < L; l++) {
        var row = el("div", "tv-row" + (l === layer ? " current" : ""));
        row.setAttribute("data-layer", String(l));
        row.appendChild(el("span", "", "L" + l));
        row.appendChild(bars(t.dense[l], t.selected[l], scale, E));
        var top = t.selected[l].map(function (ex) {
          return "E" + ex + " " + (t.dense[l][ex] / scale).toFixed(3);
        });
        // "selected", not "top": a router may rank by scores other than these probabilities
        row.appendChild(el("span", "tv-topk", "selected: " + top.join(", ")));
        panel.appendChild(row);
      }
    }

    function tokenOf(event) {
      var target = event.target;
      if (!target || !target.getAttribute) return -1;
      var v = target.getAttribute("data-token");
      return v === null ? -1 : Number(v);
    }

    textsBox.addEventListener("mouseover", function (event) {
      var i = tokenOf(event);
      if (i >= 0 && pinned < 0) show(i);
    });
    textsBox.addEventListener("click", function (event) {
      var i = tokenOf(event);
      if (i < 0) return;
      pinned = pinned === i ? -1 : i;
      show(i);
    });
    layerSel.addEventListener("change", function () {
      layer = Number(layerSel.value);
      paint();
    });
    filterSel.addEventListener("change", function () {
      filter = Number(filterSel.value);
      paint();
    });
    legend.addEventListener("click", function (event) {
      var v = event.target.getAttribute && event.target.getAttribute("data-expert");
      if (v === null || v === undefined) return;
      filter = Number(v) === filter ? -1 : Number(v);
      filterSel.value = String(filter);
      paint();
    });
    paint();
    root.setAttribute("data-ready", "1");
  }

  document.querySelectorAll(".token-view").forEach(init);
})();
