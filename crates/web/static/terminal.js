// The terminal page: xterm.js drawing a login shell in the sandbox, over
// the terminal's WebSocket (GET /v1/sandboxes/{id}/pty). A browser cannot
// send the API key's header, so each connection first asks the dashboard
// for a one-use token (POST /sandboxes/{id}/terminal-token, with the
// session's CSRF token). Binary messages carry bytes both ways; text
// messages are JSON: resizes from here, the shell's exit and errors from
// the server.
"use strict";
(function () {
  var box = document.getElementById("terminal");
  var status = document.getElementById("term-status");
  var again = document.getElementById("term-reconnect");
  var id = box.dataset.sandbox;
  var term = new Terminal({ cursorBlink: true, convertEol: false, fontSize: 14,
    fontFamily: 'ui-monospace, "DejaVu Sans Mono", monospace', scrollback: 5000 });
  var fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(box);
  fit.fit();
  var socket = null;
  var encoder = new TextEncoder();

  function say(text) { status.textContent = text; }

  function send(data) {
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(data);
  }

  term.onData(function (data) { send(encoder.encode(data)); });
  term.onBinary(function (data) {
    var bytes = new Uint8Array(data.length);
    for (var i = 0; i < data.length; i++) bytes[i] = data.charCodeAt(i) & 255;
    send(bytes);
  });
  term.onResize(function (size) {
    send(JSON.stringify({ type: "resize", rows: size.rows, cols: size.cols }));
  });
  window.addEventListener("resize", function () { fit.fit(); });

  function connect() {
    again.hidden = true;
    say("Connecting…");
    fetch("/sandboxes/" + encodeURIComponent(id) + "/terminal-token", {
      method: "POST", credentials: "same-origin",
      headers: { "x-csrf-token": box.dataset.csrf }
    }).then(function (r) {
      if (!r.ok) throw new Error("the dashboard refused a terminal (HTTP " + r.status + ")");
      return r.json();
    }).then(function (t) {
      var scheme = location.protocol === "https:" ? "wss://" : "ws://";
      var url = scheme + location.host + t.url + "&rows=" + term.rows + "&cols=" + term.cols;
      socket = new WebSocket(url);
      socket.binaryType = "arraybuffer";
      socket.onopen = function () { say("Connected"); term.focus(); };
      socket.onmessage = function (m) {
        if (typeof m.data === "string") {
          var ev = JSON.parse(m.data);
          if (ev.type === "exit") {
            say("The shell exited" + (ev.exit_code !== null ? " with code " + ev.exit_code : "") + ".");
          } else if (ev.type === "error") {
            say(ev.error.message);
          }
        } else {
          term.write(new Uint8Array(m.data));
        }
      };
      socket.onclose = function () {
        if (!/exited|stopped|hung up/.test(status.textContent)) say("Disconnected.");
        again.hidden = false;
      };
    }).catch(function (e) { say("Cannot connect: " + e.message); again.hidden = false; });
  }
  again.addEventListener("click", function () { term.reset(); connect(); });
  connect();
})();
