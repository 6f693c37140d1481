// E2B's template builder (the JavaScript SDK, unchanged) against Sandpit.
//
// Run by crates/cli/tests/e2e/templates.rs with E2B's three variables
// pointing at the server and NODE_PATH at the SDK's node_modules. A small
// template (a step as root, one as the user, env): built, a sandbox of it
// has what the steps left, in E2B's default directory and user.
import { createRequire } from "node:module";
import assert from "node:assert/strict";

const require = createRequire(import.meta.url);
const { Sandbox, Template } = require(
  require.resolve("e2b", { paths: [process.env.NODE_PATH] }),
);
const ok = (what) => console.log(`ok ${what}`);

const template = Template()
  .fromBaseImage()
  .runCmd("echo root step > /etc/from-js", { user: "root" })
  .runCmd("echo user step > js.txt")
  .setEnvs({ FROM_JS: "yes" });
const logs = [];
const info = await Template.build(template, "e2bjs", {
  onBuildLogs: (e) => logs.push(e.message),
});
assert.equal(info.templateId, "e2bjs");
assert.ok(logs.some((l) => l.includes("ready in")), logs.join("\n"));
ok("built, its log streamed to onBuildLogs");

const sandbox = await Sandbox.create("e2bjs");
const r = await sandbox.commands.run(
  "cat /etc/from-js js.txt; echo $FROM_JS; pwd; whoami; stat -c %U js.txt",
);
assert.equal(r.stdout, "root step\nuser step\nyes\n/home/user\nuser\nuser\n");
ok("steps, env, workdir and user");
await sandbox.kill();
