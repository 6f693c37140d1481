// E2B's JavaScript SDK (the npm package `e2b`), unchanged, against a
// Sandpit server, on the Node.js that SDK requires.
//
// Run by crates/cli/tests/e2e/e2b.rs with E2B_API_URL, E2B_SANDBOX_URL and
// E2B_API_KEY pointing at the server, NODE_PATH at the SDK's node_modules
// (scripts/e2b-sdks.sh installs both); SANDPIT_REVOKED_KEY is a key that was
// revoked. Prints one `ok <check>` line per check; any failure exits 1.
// The JavaScript SDK speaks Connect in JSON (the Python SDK too, with its
// own client), and reads bodies with fetch and undici: its own paths.
import { createRequire } from "node:module";
import { createHash } from "node:crypto";
import assert from "node:assert/strict";

const require = createRequire(import.meta.url);
const {
  Sandbox,
  AuthenticationError,
  CommandExitError,
  NotFoundError,
  SandboxError,
  TimeoutError,
} = require(require.resolve("e2b", { paths: [process.env.NODE_PATH] }));

const ok = (what) => console.log(`ok ${what}`);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function refused(promise, kind, what) {
  try {
    await promise;
  } catch (e) {
    assert.ok(e instanceof kind, `${what}: ${e?.constructor?.name}: ${e?.message}`);
    return e;
  }
  assert.fail(`${what}: no ${kind.name}`);
}

const sbx = await Sandbox.create({
  timeoutMs: 120_000,
  metadata: { suite: "js", run: "1" },
  envs: { FROM_CREATE: "made at create" },
});
let killed;
try {
  assert.ok(sbx.sandboxId);
  ok("create");

  let r = await sbx.commands.run("uname -a");
  assert.equal(r.exitCode, 0);
  assert.ok(r.stdout.startsWith("Linux"), r.stdout);
  ok("commands.run");

  // Output reaches the callback as it is written, not at the end.
  const seen = [];
  await sbx.commands.run("for i in 1 2 3 4; do echo line $i; sleep 1; done", {
    onStdout: (line) => seen.push([performance.now(), line]),
  });
  assert.deepEqual(
    seen.map(([, l]) => l.trim()),
    ["line 1", "line 2", "line 3", "line 4"],
  );
  const spread = (seen.at(-1)[0] - seen[0][0]) / 1000;
  assert.ok(spread >= 2.5, `the callbacks came ${spread} s apart from first to last`);
  ok(`onStdout as it comes (${spread.toFixed(1)} s from first to last)`);

  const errs = [];
  const exit = await refused(
    sbx.commands.run("echo out; echo oops >&2; exit 3", { onStderr: (l) => errs.push(l) }),
    CommandExitError,
    "a failing command",
  );
  assert.equal(exit.exitCode, 3);
  assert.equal(exit.stdout.trim(), "out");
  assert.equal(exit.stderr.trim(), "oops");
  assert.deepEqual(errs.map((e) => e.trim()), ["oops"]);
  ok("CommandExitError");

  r = await sbx.commands.run("pwd; echo $FROM_CREATE; echo $MINE", {
    cwd: "/tmp",
    envs: { MINE: "mine" },
  });
  assert.deepEqual(r.stdout.split("\n").slice(0, 3), ["/tmp", "made at create", "mine"]);
  r = await sbx.commands.run("pwd; whoami");
  assert.deepEqual(r.stdout.split(/\s+/).filter(Boolean), ["/home/user", "user"]);
  ok("cwd, envs, the create's envs, the default user");

  await refused(sbx.commands.run("sleep 30", { timeoutMs: 2000 }), TimeoutError, "a command past its timeout");
  ok("timeoutMs");

  const root = await refused(sbx.commands.run("id", { user: "root" }), SandboxError, "root");
  assert.match(root.message, /unprivileged/);
  ok("another user is refused, saying why");

  // A background command by its real pid: listed, followed by a second
  // client from then on, fed, killed.
  const ticker = await sbx.commands.run(
    "for i in $(seq 1 60); do echo tick $i; sleep 0.5; done",
    { background: true },
  );
  assert.ok(ticker.pid > 1, ticker.pid);
  const listed = await sbx.commands.list();
  const mine = listed.find((p) => p.pid === ticker.pid);
  assert.ok(mine && `${mine.cmd} ${mine.args.join(" ")}`.includes("tick"), JSON.stringify(listed));
  await ticker.disconnect();
  await sleep(1500);
  const other = await Sandbox.connect(sbx.sandboxId);
  const ticks = [];
  const later = await other.commands.connect(ticker.pid, {
    onStdout: (d) => ticks.push(...d.split("\n").filter((l) => l.startsWith("tick"))),
  });
  // Killed once the second client has seen three ticks (a busy host may
  // take longer than their second and a half).
  const ended = refused(later.wait(), CommandExitError, "a killed command");
  const deadline = Date.now() + 60_000;
  while (ticks.length < 3 && Date.now() < deadline) await sleep(100);
  await sbx.commands.kill(ticker.pid);
  await ended;
  const numbers = ticks.map((l) => Number(l.split(" ")[1]));
  assert.ok(numbers.length >= 3 && numbers[0] > 1, `the second client saw ${numbers}`);
  assert.deepEqual(numbers, numbers.map((_, i) => numbers[0] + i));
  assert.equal(await sbx.commands.kill(ticker.pid), false, "an ended command was killed");
  ok(`background, list, connect from a second client (from tick ${numbers[0]}), kill`);

  const cat = await sbx.commands.run("cat; echo done >&2", { background: true, stdin: true });
  await cat.sendStdin("hello ");
  await sbx.commands.sendStdin(cat.pid, new TextEncoder().encode("stdin\n"));
  await cat.closeStdin();
  r = await cat.wait();
  assert.equal(r.stdout, "hello stdin\n");
  assert.equal(r.stderr.trim(), "done");
  ok("sendStdin, closeStdin");

  // A server in the sandbox reached through getHost with Node's own fetch
  // (undici, which asks the system's resolver for the *.localhost name).
  await sbx.files.write("site/index.html", "served from the sandbox\n");
  const server = await sbx.commands.run("cd site && exec python3 -m http.server 8000", {
    background: true,
  });
  const host = sbx.getHost(8000);
  assert.ok(host.startsWith(`8000-${sbx.sandboxId}.`), host);
  let body;
  for (const deadline = Date.now() + 60_000; ; await sleep(500)) {
    const resp = await fetch(`http://${host}/index.html`);
    if (resp.status === 200) {
      body = await resp.text();
      break;
    }
    // 502 until the server listens.
    assert.ok(resp.status === 502 && Date.now() < deadline, `status ${resp.status}`);
  }
  assert.equal(body, "served from the sandbox\n");
  assert.equal(await server.kill(), true);
  ok(`getHost: a background http.server reached with fetch at ${host.split(".")[0]}…`);

  const info = await sbx.files.write("notes/hello.txt", "hello from the SDK\n");
  assert.equal(info.path, "/home/user/notes/hello.txt");
  assert.equal(await sbx.files.read("notes/hello.txt"), "hello from the SDK\n");
  const blob = new Uint8Array(256 * 4096).map((_, i) => i % 256);
  await sbx.files.write("/tmp/blob.bin", blob.buffer);
  const back = await sbx.files.read("/tmp/blob.bin", { format: "bytes" });
  assert.equal(Buffer.compare(Buffer.from(back), Buffer.from(blob)), 0, `read back ${back.length} bytes`);
  r = await sbx.commands.run("sha256sum /tmp/blob.bin | cut -c1-16");
  assert.equal(r.stdout.trim(), createHash("sha256").update(blob).digest("hex").slice(0, 16));
  await refused(sbx.files.read("/no/such/file"), NotFoundError, "a missing file");
  ok("files.write and files.read (text, 1 MiB of every byte value, a missing file)");

  assert.equal(await sbx.files.exists("notes/hello.txt"), true);
  assert.equal(await sbx.files.exists("notes/nothing"), false);
  const fi = await sbx.files.getInfo("notes/hello.txt");
  assert.deepEqual([fi.name, fi.path, fi.size, fi.type], ["hello.txt", "/home/user/notes/hello.txt", 19, "file"]);
  assert.equal(await sbx.files.makeDir("deep/er/est"), true);
  assert.equal(await sbx.files.makeDir("deep/er"), false, "making a directory that is there");
  await sbx.files.write("deep/er/est/leaf.txt", "leaf");
  const all3 = (await sbx.files.list("deep", { depth: 3 })).map((e) => e.path).sort();
  assert.deepEqual(all3, ["/home/user/deep/er", "/home/user/deep/er/est", "/home/user/deep/er/est/leaf.txt"]);
  const moved = await sbx.files.rename("deep/er/est/leaf.txt", "deep/leaf.txt");
  assert.equal(moved.path, "/home/user/deep/leaf.txt");
  await sbx.files.remove("deep");
  assert.equal(await sbx.files.exists("deep"), false);
  await refused(sbx.files.makeDir("/root/mine"), SandboxError, "a directory in /root");
  ok("files.exists, getInfo, makeDir, list with depth, rename, remove");

  // watchDir: a stream of what a command does in the tree, as it happens.
  await sbx.files.makeDir("jwatched/sub");
  const seenEvents = [];
  const watching = await sbx.files.watchDir("jwatched", (e) => seenEvents.push(`${e.type} ${e.name}`), {
    recursive: true,
  });
  await sbx.commands.run("echo hi > jwatched/sub/a.txt && rm jwatched/sub/a.txt");
  for (let i = 0; i < 300 && !seenEvents.includes("remove sub/a.txt"); i++) await sleep(100);
  assert.deepEqual(
    seenEvents.filter((e) => e.endsWith("sub/a.txt")).filter((e, i, all) => all.indexOf(e) === i),
    ["create sub/a.txt", "write sub/a.txt", "remove sub/a.txt"],
    JSON.stringify(seenEvents),
  );
  await watching.stop();
  await refused(sbx.files.watchDir("no/such/dir", () => {}), NotFoundError, "watching a missing directory");
  ok("watchDir: create, write, remove, recursive, stop");

  // Signed URLs, opened with Node's own fetch: no SDK, no headers.
  await sbx.files.write("signed.txt", "hello world");
  let res = await fetch(await sbx.downloadUrl("signed.txt", { useSignatureExpiration: 10_000 }));
  assert.deepEqual([res.status, await res.text()], [200, "hello world"]);
  res = await fetch(await sbx.downloadUrl("signed.txt", { useSignatureExpiration: -10_000 }));
  assert.deepEqual([res.status, await res.json()], [401, { code: 401, message: "signature is already expired" }]);
  const form = new FormData();
  form.append("file", "file content");
  res = await fetch(await sbx.uploadUrl("uploaded.txt", { useSignatureExpiration: 10_000 }), { method: "POST", body: form });
  assert.deepEqual([res.status, await res.json()], [200, [{ name: "uploaded.txt", path: "/home/user/uploaded.txt", type: "file" }]]);
  assert.equal(await sbx.files.read("uploaded.txt"), "file content");
  ok("downloadUrl and uploadUrl, signed, opened with fetch (an expired one refused)");

  const packed = "gzip me, sandbox\n".repeat(100_000);
  await sbx.files.write("gz/packed.txt", packed, { gzip: true });
  assert.equal(await sbx.files.read("gz/packed.txt"), packed);
  ok("a gzip upload");

  assert.equal(await sbx.isRunning(), true);
  const got = await sbx.getInfo();
  assert.equal(got.sandboxId, sbx.sandboxId);
  assert.deepEqual(got.metadata, { suite: "js", run: "1" });
  assert.equal(got.state, "running");
  const found = await Sandbox.list({ query: { metadata: { suite: "js" } } }).nextItems();
  assert.deepEqual(found.map((s) => s.sandboxId), [sbx.sandboxId]);
  const none = await Sandbox.list({ query: { metadata: { suite: "nobody" } } }).nextItems();
  assert.deepEqual(none, []);
  ok("isRunning, getInfo, list filtered by metadata");

  // An empty answer, once seen here and never through Python, is shown
  // with what the API says of it, raw.
  const metricsOrWhy = async () => {
    const got = await sbx.getMetrics();
    if (got.length > 0) return got;
    const raw = await fetch(`${process.env.E2B_API_URL}/sandboxes/${sbx.sandboxId}/metrics`, {
      headers: { "X-API-KEY": process.env.E2B_API_KEY },
    });
    const info = await Sandbox.getInfo(sbx.sandboxId);
    assert.fail(`getMetrics gave []; the API says ${raw.status} ${await raw.text()}; state ${info.state}`);
  };
  const metrics = await metricsOrWhy();
  const m = metrics[metrics.length - 1];
  assert.equal(m.cpuCount, 2);
  assert.ok(m.cpuUsedPct >= 0 && m.cpuUsedPct <= 100, JSON.stringify(m));
  assert.ok(m.memUsed > 0 && m.memUsed < m.memTotal, JSON.stringify(m));
  assert.ok(m.diskUsed > 0 && m.diskUsed < m.diskTotal, JSON.stringify(m));
  assert.ok(m.timestamp instanceof Date, JSON.stringify(m));
  assert.ok((await metricsOrWhy()).length >= 2, "the readings are kept");
  ok("getMetrics");

  const before = (await sbx.getInfo()).endAt;
  await sbx.setTimeout(600_000);
  const after = (await sbx.getInfo()).endAt;
  assert.ok(after > before, `${before} → ${after}`);
  const asked = Date.now() + 300_000;
  await sbx.setTimeout(300_000);
  const shorter = (await sbx.getInfo()).endAt.getTime();
  // Whole minutes from the creation: within a minute after what was asked.
  assert.ok(asked - 1000 <= shorter && shorter < asked + 61_000, `${asked} → ${shorter}`);
  ok("setTimeout, longer then shorter");

  await sbx.files.write("kept.txt", "kept in the snapshot");
  const snap = await sbx.createSnapshot();
  assert.match(snap.snapshotId, /^snap_/);
  const fromSnap = await Sandbox.create(snap.snapshotId, { timeoutMs: 60_000 });
  try {
    assert.notEqual(fromSnap.sandboxId, sbx.sandboxId);
    assert.equal(await fromSnap.files.read("kept.txt"), "kept in the snapshot");
  } finally {
    await fromSnap.kill();
  }
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true);
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false);
  ok("createSnapshot, create from it, deleteSnapshot");

  await sbx.commands.run("nohup sleep 1000 >/dev/null 2>&1 & echo $! > /tmp/sleeper");
  assert.equal(await sbx.pause(), true);
  assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, "paused");
  assert.equal(await sbx.isRunning(), false);
  const resumed = await Sandbox.connect(sbx.sandboxId);
  r = await resumed.commands.run("kill -0 $(cat /tmp/sleeper) && echo intact");
  assert.equal(r.stdout.trim(), "intact");
  ok("pause, then connect resumes it with its processes");

  r = await resumed.commands.run(`curl -sS -m 20 ${process.env.SANDPIT_INTERNET}`);
  assert.equal(r.stdout, "hello from the internet\n");
  ok("the internet reached");
} finally {
  killed = await sbx.kill();
}
assert.equal(killed, true);
await refused(Sandbox.getInfo(sbx.sandboxId), NotFoundError, "a killed sandbox");
assert.equal(await Sandbox.kill(sbx.sandboxId), false);
ok("kill; a killed sandbox is not found");

// allowInternetAccess: false: the harness's "internet" is refused at once
// (curl's 7, not a timeout's 28), which the first sandbox reached.
const offline = await Sandbox.create({ allowInternetAccess: false, timeoutMs: 60_000 });
try {
  const tried = await offline.commands.run(
    `curl -sS -m 20 -o /dev/null ${process.env.SANDPIT_INTERNET}; echo $?`,
  );
  assert.equal(tried.stdout.trim().split("\n").at(-1), "7", tried.stdout + tried.stderr);
} finally {
  await offline.kill();
}
ok("allowInternetAccess: false: nothing leaves");

for (const apiKey of ["e2b_" + "0".repeat(50), process.env.SANDPIT_REVOKED_KEY]) {
  await refused(Sandbox.create({ apiKey }), AuthenticationError, "a bad key");
}
ok("a wrong or revoked key is refused");

// An account without credit: refused, saying why.
const broke = await refused(
  Sandbox.create({ apiKey: process.env.SANDPIT_BROKE_KEY }),
  SandboxError,
  "an account without credit",
);
assert.match(broke.message, /credit/);
ok("an account without credit is refused, saying why");
