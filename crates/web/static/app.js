// Keeps every expiry countdown (<time class="countdown" datetime=...>) live,
// and a webhook form's "All events" box in step with its event types (the
// server reads only the types: none ticked is all).
"use strict";
(function () {
  function span(secs) {
    if (secs < 60) return secs + " s";
    if (secs < 3600) return Math.floor(secs / 60) + " min " + (secs % 60) + " s";
    if (secs < 86400) return Math.floor(secs / 3600) + " h " + Math.floor((secs % 3600) / 60) + " min";
    return Math.floor(secs / 86400) + " d " + Math.floor((secs % 86400) / 3600) + " h";
  }
  function tick() {
    var now = Date.now();
    document.querySelectorAll("time.countdown").forEach(function (el) {
      var left = Math.floor((Date.parse(el.getAttribute("datetime")) - now) / 1000);
      el.textContent = left > 0 ? "in " + span(left) : "now";
    });
  }
  function eventBoxes() {
    var all = document.querySelector("input[data-all-events]");
    if (!all) return;
    var types = document.querySelectorAll("input[data-event-type]");
    all.addEventListener("change", function () {
      if (all.checked) types.forEach(function (t) { t.checked = false; });
      else if (![].some.call(types, function (t) { return t.checked; })) all.checked = true;
    });
    types.forEach(function (t) {
      t.addEventListener("change", function () {
        all.checked = ![].some.call(types, function (x) { return x.checked; });
      });
    });
  }
  document.addEventListener("DOMContentLoaded", function () {
    tick();
    setInterval(tick, 1000);
    eventBoxes();
  });
})();
