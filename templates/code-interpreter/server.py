"""Sandpit's code interpreter: Jupyter kernels behind the HTTP API that
E2B's `e2b_code_interpreter` SDK speaks, on port 49999 of the sandbox.

The SDK reaches this port through Sandpit's E2B data plane (the request
names the sandbox and the port in its headers) and sends:

- `POST /execute` `{"code", "context_id"?, "language"?, "env_vars"?}`:
  the answer is a stream of JSON lines, one per event of the run:
  `{"type": "stdout"|"stderr", "text", "timestamp"}`,
  `{"type": "result", "text"?, "html"?, "png"?, …, "is_main_result"}`
  (a display or the cell's value; images in base64),
  `{"type": "error", "name", "value", "traceback"}` and
  `{"type": "number_of_executions", "execution_count"}`.
- `POST /contexts` `{"language"?, "cwd"?}` -> `{"id", "language", "cwd"}`:
  a kernel of its own (state kept between runs), `GET /contexts`,
  `DELETE /contexts/{id}`, `POST /contexts/{id}/restart`.
- `GET /health`: the template's ready check.

The default context's kernel starts with the server, so a template saved
once this answers has it running: a sandbox's first `run_code` does not
wait for Python to start. Only Python kernels are served (`language`
`python`, or none); others are refused with a 400 that says so.

Standard library and `jupyter_client` only; run as the sandbox's user.
"""

import datetime
import json
import os
import queue
import threading
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jupyter_client.manager import KernelManager

PORT = int(os.environ.get("SANDPIT_CODE_INTERPRETER_PORT", "49999"))
HOME = os.path.expanduser("~")

# MIME types of a display, as the SDK names them in a result.
FORMATS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


class Context:
    """A kernel and the lock that gives it one run at a time."""

    def __init__(self, cwd):
        self.id = str(uuid.uuid4())
        self.cwd = cwd
        self.lock = threading.Lock()
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=cwd)
        self.client = self.manager.blocking_client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def describe(self):
        return {"id": self.id, "language": "python", "cwd": self.cwd}

    def stop(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)

    def restart(self):
        with self.lock:
            self.manager.restart_kernel(now=True)
            self.client.wait_for_ready(timeout=120)

    def run(self, code, env_vars, emit):
        """Runs `code`, calling `emit` with each event (a dict) as it comes."""
        with self.lock:
            if env_vars:
                # Set for this run only, as E2B does: put back after it.
                setup = (
                    "import os as __sp_os\n"
                    f"__sp_saved = {{k: __sp_os.environ.get(k) for k in {list(env_vars)!r}}}\n"
                    f"__sp_os.environ.update({dict(env_vars)!r})\n"
                )
                self.client.execute(setup, silent=True, store_history=False)
            try:
                self._run(code, emit)
            finally:
                if env_vars:
                    restore = (
                        "for __sp_k, __sp_v in __sp_saved.items():\n"
                        "    if __sp_v is None: __sp_os.environ.pop(__sp_k, None)\n"
                        "    else: __sp_os.environ[__sp_k] = __sp_v\n"
                    )
                    self.client.execute(restore, silent=True, store_history=False)

    def _run(self, code, emit):
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False)
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=3600)
            except queue.Empty:
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            content = msg["content"]
            if kind == "stream":
                emit({"type": content["name"], "text": content["text"], "timestamp": now()})
            elif kind in ("execute_result", "display_data"):
                result = {"type": "result", "is_main_result": kind == "execute_result"}
                extra = {}
                for mime, value in content.get("data", {}).items():
                    name = FORMATS.get(mime)
                    if name:
                        result[name] = value
                    else:
                        extra[mime] = value
                if extra:
                    result["extra"] = extra
                emit(result)
            elif kind == "error":
                emit(
                    {
                        "type": "error",
                        "name": content["ename"],
                        "value": content["evalue"],
                        "traceback": "\n".join(content["traceback"]),
                    }
                )
            elif kind == "execute_input":
                emit(
                    {
                        "type": "number_of_executions",
                        "execution_count": content["execution_count"],
                    }
                )
            elif kind == "status" and content["execution_state"] == "idle":
                return


CONTEXTS = {}
CONTEXTS_LOCK = threading.Lock()
DEFAULT = None


def python_only(language):
    return language in (None, "", "python", "python3")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sandpit-code-interpreter"

    def log_message(self, fmt, *args):
        pass

    def body(self):
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        return json.loads(raw or b"{}")

    def answer(self, status, value):
        data = json.dumps(value).encode() if not isinstance(value, bytes) else value
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def refuse(self, status, message):
        self.answer(status, {"error": message})

    def do_GET(self):
        if self.path == "/health":
            self.answer(HTTPStatus.OK, {"status": "ok"})
        elif self.path == "/contexts":
            with CONTEXTS_LOCK:
                self.answer(HTTPStatus.OK, [c.describe() for c in CONTEXTS.values()])
        else:
            self.refuse(HTTPStatus.NOT_FOUND, f"no route {self.path}")

    def do_DELETE(self):
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts":
            with CONTEXTS_LOCK:
                context = CONTEXTS.pop(parts[1], None)
            if context is None:
                return self.refuse(HTTPStatus.NOT_FOUND, f"no context {parts[1]}")
            context.stop()
            self.answer(HTTPStatus.OK, {})
        else:
            self.refuse(HTTPStatus.NOT_FOUND, f"no route {self.path}")

    def do_POST(self):
        try:
            body = self.body()
        except ValueError as e:
            return self.refuse(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {e}")
        parts = self.path.strip("/").split("/")
        if self.path == "/execute":
            return self.execute(body)
        if self.path == "/contexts":
            if not python_only(body.get("language")):
                return self.refuse(
                    HTTPStatus.BAD_REQUEST,
                    f"language {body.get('language')!r}: this code interpreter runs Python",
                )
            context = Context(body.get("cwd") or HOME)
            with CONTEXTS_LOCK:
                CONTEXTS[context.id] = context
            return self.answer(HTTPStatus.OK, context.describe())
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
            with CONTEXTS_LOCK:
                context = CONTEXTS.get(parts[1])
            if context is None:
                return self.refuse(HTTPStatus.NOT_FOUND, f"no context {parts[1]}")
            context.restart()
            return self.answer(HTTPStatus.OK, {})
        self.refuse(HTTPStatus.NOT_FOUND, f"no route {self.path}")

    def execute(self, body):
        code = body.get("code")
        if not isinstance(code, str):
            return self.refuse(HTTPStatus.BAD_REQUEST, "code is required")
        if not python_only(body.get("language")):
            return self.refuse(
                HTTPStatus.BAD_REQUEST,
                f"language {body.get('language')!r}: this code interpreter runs Python",
            )
        context_id = body.get("context_id")
        with CONTEXTS_LOCK:
            context = CONTEXTS.get(context_id) if context_id else DEFAULT
        if context is None:
            return self.refuse(HTTPStatus.NOT_FOUND, f"no context {context_id}")
        self.send_response(HTTPStatus.OK)
        self.send_header("content-type", "application/x-ndjson")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def emit(event):
            line = json.dumps(event).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()

        try:
            context.run(code, body.get("env_vars") or {}, emit)
        finally:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()


def main():
    global DEFAULT
    DEFAULT = Context(HOME)
    with CONTEXTS_LOCK:
        CONTEXTS[DEFAULT.id] = DEFAULT
    server = ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
