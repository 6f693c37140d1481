"""E2B's template builder (the Python SDK, unchanged) against Sandpit.

Run by crates/cli/tests/e2e/templates.rs with E2B's three variables pointing
at the server, SANDPIT_REPO at the test's package repositories (an apt
repository under /apt, a PyPI simple index under /simple) and
SANDPIT_CONTEXT at a directory holding site/index.html. Prints one
`ok <check>` line per check; any failure exits non-zero.

The template is what a user writes from E2B's docs: apt and pip helpers,
env, workdir, two copies (a directory, and a file renamed with a mode), and
a start command with `wait_for_port`. Built, a sandbox of it serves its page
at its first request; built again unchanged, every step is cached; an image
Sandpit cannot build is refused with the reason.
"""

import os
import urllib.request

from e2b import Sandbox, Template, wait_for_port
from e2b.exceptions import BuildException

repo = os.environ["SANDPIT_REPO"]
repo_host = repo.split("//", 1)[1].split(":", 1)[0]
context = os.environ["SANDPIT_CONTEXT"]


def ok(what):
    print("ok", what, flush=True)


template = (
    Template(file_context_path=context)
    .from_base_image()
    # The test's own repository instead of Debian's (no traffic leaves the
    # test's machine).
    .run_cmd(
        "rm -f /etc/apt/sources.list /etc/apt/sources.list.d/* && "
        f'echo "deb [trusted=yes] {repo}/apt ./" > /etc/apt/sources.list.d/tests.list',
        user="root",
    )
    .apt_install("sandpit-hello")
    .set_envs(
        {
            "PIP_INDEX_URL": f"{repo}/simple/",
            "PIP_TRUSTED_HOST": repo_host,
            "GREETING": "hello from the e2b builder",
        }
    )
    .pip_install("sandpit-greet")  # as root, for every user (the SDK's default)
    .set_workdir("/srv/app")
    .copy("site/", "./")
    .copy("site/index.html", "/srv/app/private.html", mode=0o600)
    .set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))
)

logs = []
info = Template.build(template, "e2bweb:v1", on_build_logs=lambda e: logs.append(e.message))
assert info.template_id == "e2bweb", info
assert info.build_id.startswith("tpl_"), info
text = "\n".join(logs)
assert "Unpacking sandpit-hello" in text, text
assert "Successfully installed sandpit-greet" in text, text
assert "ready in" in text, text
ok("built, its log streamed to on_build_logs")
assert Template.exists("e2bweb:v1")
assert not Template.exists("no-such-template")
ok("Template.exists")

sandbox = Sandbox.create("e2bweb:v1")
page = urllib.request.urlopen("http://" + sandbox.get_host(8000), timeout=60).read().decode()
assert page == "<h1>hello from the e2b builder</h1>\n", page
ok("its server answers the first request")
r = sandbox.commands.run(
    "sandpit-hello; python3 -c 'import sandpit_greet; print(sandpit_greet.greet())'; "
    "echo $GREETING; pwd; whoami; stat -c '%a %U' private.html index.html"
)
assert r.stdout == (
    "hello from apt\nhello from pip\nhello from the e2b builder\n/srv/app\nuser\n"
    "600 user\n644 user\n"
), r.stdout
ok("packages, env, workdir, user and copies")
sandbox.kill()

logs.clear()
Template.build(template, "e2bweb:v1", on_build_logs=lambda e: logs.append(e.message))
text = "\n".join(logs)
assert "the whole template is cached" in text, text
assert "Skipping upload of 'site/', already cached" in text, text
ok("built again unchanged: cached, files not uploaded again")

try:
    Template.build(Template().from_image("ubuntu:24.04").run_cmd("true"), "bad")
    raise SystemExit("an Ubuntu image was built")
except BuildException as e:
    assert "standard image" in str(e), e
ok("another image refused with the reason")
