// Keeps every expiry countdown (<time class="countdown" datetime=...>) live.
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
  document.addEventListener("DOMContentLoaded", function () {
    tick();
    setInterval(tick, 1000);
  });
})();
