//! Templates as a user builds and uses one: `sandpit template build` of a
//! Dockerfile against a real server (an apt package and a pip package from
//! the test's own repositories on a test host, a copied file, ENV, WORKDIR,
//! USER, and a start command with a ready check); a sandbox from it answers
//! on its preview URL at its first request, no command run; a rebuild with
//! the last changing step changed takes the steps before it from the
//! cache; another account can neither see nor start it until an operator
//! publishes it; what cannot be built is refused with its reason, and a
//! ready check that never passes fails the build with the command's last
//! lines.

use crate::common::netns::{HostNetworkLock, TestHost};
use crate::common::serve::{sandpit, Rest, Server};
use crate::common::*;
use serde_json::{json, Value};
use sha2::Digest;
use std::path::Path;
use std::time::Duration;

const HOST_SIDE: &str = "198.18.72.1";
/// The test's package repositories (a public address: the guest's
/// default deny list does not hold it).
const REPO: &str = "198.18.72.2";

/// An apt repository (a flat one: `Packages` and an unsigned `Release`,
/// which `[trusted=yes]` takes) with `sandpit-hello`, and a PyPI simple
/// index with `sandpit-greet`, under `www`.
fn make_repositories(www: &Path) {
    // The .deb, built by dpkg-deb.
    let pkg = www.join("pkg");
    std::fs::create_dir_all(pkg.join("DEBIAN")).unwrap();
    std::fs::create_dir_all(pkg.join("usr/bin")).unwrap();
    std::fs::write(
        pkg.join("DEBIAN/control"),
        "Package: sandpit-hello\nVersion: 1.0\nArchitecture: all\nMaintainer: tests <t@example.test>\n\
         Description: says hello\n",
    )
    .unwrap();
    let bin = pkg.join("usr/bin/sandpit-hello");
    std::fs::write(&bin, "#!/bin/sh\necho hello from apt\n").unwrap();
    std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let apt = www.join("apt");
    std::fs::create_dir_all(&apt).unwrap();
    let deb = apt.join("sandpit-hello_1.0_all.deb");
    let built = std::process::Command::new("dpkg-deb")
        .args(["--root-owner-group", "--build"])
        .arg(&pkg)
        .arg(&deb)
        .output()
        .expect("dpkg-deb (install dpkg)");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    std::fs::remove_dir_all(&pkg).unwrap();
    let bytes = std::fs::read(&deb).unwrap();
    let packages = format!(
        "Package: sandpit-hello\nVersion: 1.0\nArchitecture: all\nMaintainer: tests <t@example.test>\n\
         Filename: ./sandpit-hello_1.0_all.deb\nSize: {}\nSHA256: {}\nDescription: says hello\n\n",
        bytes.len(),
        hex::encode(sha2::Sha256::digest(&bytes))
    );
    std::fs::write(apt.join("Packages"), &packages).unwrap();
    std::fs::write(
        apt.join("Release"),
        format!(
            "Origin: tests\nLabel: tests\nDate: Sat, 05 Dec 2026 00:00:00 UTC\nArchitectures: all amd64\nSHA256:\n {} {} Packages\n",
            hex::encode(sha2::Sha256::digest(packages.as_bytes())),
            packages.len()
        ),
    )
    .unwrap();
    // The wheel, zipped by Python with its RECORD's hashes.
    let files = www.join("files");
    std::fs::create_dir_all(&files).unwrap();
    let made = std::process::Command::new("python3")
        .arg("-c")
        .arg(
            r#"
import base64, hashlib, sys, zipfile
out = sys.argv[1]
members = {
    "sandpit_greet/__init__.py": "def greet():\n    return 'hello from pip'\n",
    "sandpit_greet-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: sandpit-greet\nVersion: 1.0\n",
    "sandpit_greet-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = []
with zipfile.ZipFile(out, "w") as z:
    for name, text in members.items():
        data = text.encode()
        z.writestr(name, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("sandpit_greet-1.0.dist-info/RECORD,,")
    z.writestr("sandpit_greet-1.0.dist-info/RECORD", "\n".join(record) + "\n")
"#,
        )
        .arg(files.join("sandpit_greet-1.0-py3-none-any.whl"))
        .output()
        .expect("python3");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let simple = www.join("simple/sandpit-greet");
    std::fs::create_dir_all(&simple).unwrap();
    std::fs::write(
        simple.join("index.html"),
        "<html><body><a href=\"/files/sandpit_greet-1.0-py3-none-any.whl\">\
         sandpit_greet-1.0-py3-none-any.whl</a></body></html>\n",
    )
    .unwrap();
}

/// The Dockerfile of the test's template, its page saying `page`.
fn write_context(dir: &Path, page: &str) {
    std::fs::create_dir_all(dir.join("site")).unwrap();
    std::fs::write(dir.join("site/index.html"), page).unwrap();
    let apt =
        "-o Dir::Etc::sourcelist=/etc/apt/sources.list.d/tests.list -o Dir::Etc::sourceparts=-";
    std::fs::write(
        dir.join("Dockerfile"),
        format!(
            "FROM sandpit\n\
             ARG REPO=http://{REPO}:8080\n\
             RUN echo \"deb [trusted=yes] $REPO/apt ./\" > /etc/apt/sources.list.d/tests.list \\\n\
             \x20&& apt-get {apt} update && apt-get {apt} install -y sandpit-hello\n\
             RUN pip install --break-system-packages --index-url $REPO/simple/ --trusted-host {REPO} sandpit-greet\n\
             ENV GREETING=\"hello from env\" PYTHONUNBUFFERED=1\n\
             WORKDIR /srv/site\n\
             COPY site/ ./\n\
             USER user\n\
             EXPOSE 8000\n\
             CMD [\"python3\", \"-m\", \"http.server\", \"8000\"]\n\
             HEALTHCHECK CMD curl -fsS http://127.0.0.1:8000/ >/dev/null\n"
        ),
    )
    .unwrap();
}

/// `sandpit template build` as a user runs it: its exit code, stdout and
/// stderr (the build's log).
fn template_build(server: &Server, key: &str, dir: &Path, extra: &[&str]) -> (i32, String, String) {
    let out = sandpit(&server.data)
        .current_dir(dir)
        .env("SANDPIT_URL", &server.url)
        .env("SANDPIT_API_KEY", key)
        .args(["template", "build", "web"])
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The page a sandbox of the template serves on its preview URL, fetched
/// as a user's program would (the system resolver finds `*.localhost`).
async fn first_page(api: &Rest, id: &str) -> String {
    let (st, port) = api
        .post(&format!("/sandboxes/{id}/ports"), json!({"port": 8000}))
        .await;
    assert_eq!(st, 200, "{port}");
    let url = port["url"].as_str().unwrap().to_string();
    let resp = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
        .get(&url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    assert_eq!(resp.status(), 200, "{url}");
    resp.text().await.unwrap()
}

async fn create_from(api: &Rest, template: &str) -> (u16, Value) {
    api.post(
        "/sandboxes",
        json!({"template": template, "timeout_minutes": 10}),
    )
    .await
}

#[test]
fn a_dockerfile_template_starts_sandboxes_with_its_server_up_and_rebuilds_from_its_cache() {
    let _net = HostNetworkLock::changing();
    let www = tempfile::tempdir().unwrap();
    make_repositories(www.path());
    let mut host = TestHost::start("tpl", HOST_SIDE, REPO);
    host.serve_http(www.path());
    let data = data_dir();
    // Four templates per account: the fifth name is refused.
    // And a second size, which a template may be built for.
    let server = Server::start_with(
        &data,
        "[limits]\nmax_templates = 4\n\
         [sizes.medium]\nvcpus = 2\nmemory_mb = 1536\ndisk_gb = 4\nprice_usd_per_hour = 0.18\n",
    );
    let key = server.new_account("builder", 50.0);
    let other_key = server.new_account("neighbour", 50.0);
    let api = Rest::new(&server, &key);
    let other = Rest::new(&server, &other_key);
    let context = tempfile::tempdir().unwrap();
    write_context(context.path(), "<h1>hello from the template</h1>\n");
    let rt = tokio::runtime::Runtime::new().unwrap();

    let (code, first_id, log) = template_build(&server, &key, context.path(), &[]);
    assert_eq!(code, 0, "the build failed:\n{log}");
    assert!(first_id.starts_with("tpl_"), "{first_id}");
    assert!(log.contains("step 1/6: RUN"), "{log}");
    assert!(
        log.contains("Unpacking sandpit-hello"),
        "apt's output is not in the log:\n{log}"
    );
    assert!(log.contains("ready after"), "{log}");
    assert!(
        !log.contains("(cached)"),
        "the first build had nothing to reuse:\n{log}"
    );
    assert!(log.contains("EXPOSE 8000 is not used"), "{log}");

    rt.block_on(async {
        let (st, t) = api.get("/templates/web").await;
        assert_eq!(st, 200, "{t}");
        assert_eq!(
            (t["id"].as_str(), t["status"].as_str()),
            (Some(first_id.as_str()), Some("ready"))
        );
        assert_eq!(t["steps"], 6);
        assert!(t["size_bytes"].as_u64() > Some(0), "{t}");

        // A sandbox of it: the server answers its first request, before
        // any command ran in it.
        let (st, sbx) = create_from(&api, "web").await;
        assert_eq!(st, 201, "{sbx}");
        assert_eq!(sbx["template_id"], first_id.as_str());
        let id = sbx["id"].as_str().unwrap();
        assert_eq!(
            first_page(&api, id).await,
            "<h1>hello from the template</h1>\n"
        );
        // The same server named as E2B's SDKs name a sandbox's port when
        // E2B_SANDBOX_URL is set (the code interpreter's `run_code`):
        // headers on the server's own URL.
        let direct = reqwest::Client::new()
            .get(format!("{}/", server.url))
            .header("e2b-sandbox-id", id)
            .header("e2b-sandbox-port", "8000")
            .send()
            .await
            .unwrap();
        assert_eq!(direct.status(), 200);
        assert_eq!(
            direct.text().await.unwrap(),
            "<h1>hello from the template</h1>\n"
        );
        // Its packages, environment and directory are the template's; its
        // commands are the unprivileged user's.
        assert_eq!(api.sh(id, "sandpit-hello").await, "hello from apt");
        assert_eq!(
            api.sh(
                id,
                "python3 -c 'import sandpit_greet; print(sandpit_greet.greet())'"
            )
            .await,
            "hello from pip"
        );
        assert_eq!(
            api.sh(id, "echo \"$GREETING\"; pwd; id -un").await,
            "hello from env\n/srv/site\nuser"
        );
        // The start command runs as the build's last user.
        assert_eq!(api.sh(id, "ps -o user= -C python3 | sort -u").await, "user");

        // Another account sees nothing and starts nothing of it.
        let (st, _) = other.get("/templates/web").await;
        assert_eq!(st, 404);
        let (st, body) = create_from(&other, "web").await;
        assert_eq!(st, 404, "{body}");
        let (_, list) = other.get("/templates").await;
        assert_eq!(list["data"], json!([]), "{list}");
    });

    // E2B's SDK starts it by name, as `Sandbox.create("web")`: its server
    // answers on `get_host(8000)` (reached through the system resolver).
    let e2b = std::process::Command::new(crate::e2b::sdk_python())
        .arg("-c")
        .arg(
            "from e2b import Sandbox\n\
             import urllib.request\n\
             s = Sandbox.create('web')\n\
             print(urllib.request.urlopen('http://' + s.get_host(8000), timeout=60).read().decode().strip())\n\
             print(s.commands.run('sandpit-hello; echo $GREETING').stdout.strip())\n\
             s.kill()\n",
        )
        .env("E2B_API_URL", format!("{}/e2b", server.url))
        .env("E2B_SANDBOX_URL", &server.url)
        .env("E2B_API_KEY", sandpit_store::e2b_spelling(&key).unwrap())
        .output()
        .unwrap();
    assert!(
        e2b.status.success(),
        "E2B's Sandbox.create('web'): {}",
        String::from_utf8_lossy(&e2b.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&e2b.stdout),
        "<h1>hello from the template</h1>\nhello from apt\nhello from env\n"
    );

    // E2B's template builder, in both SDKs at once: Python's builds with
    // apt and pip from the test's repositories, copies and a start
    // command; JavaScript's a small one.
    let e2b_context = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(e2b_context.path().join("site")).unwrap();
    std::fs::write(
        e2b_context.path().join("site/index.html"),
        "<h1>hello from the e2b builder</h1>\n",
    )
    .unwrap();
    let repo = format!("http://{REPO}:8080");
    let (node, node_modules) = crate::e2b::sdk_js();
    let (python_checks, js_checks) = std::thread::scope(|scope| {
        let js = scope.spawn(|| {
            crate::e2b::run_sdk_with(
                &node,
                "template_build.mjs",
                &server,
                &key,
                &key,
                &key,
                &[("NODE_PATH", node_modules.as_os_str())],
            )
        });
        let python = crate::e2b::run_sdk_with(
            &crate::e2b::sdk_python(),
            "template_build.py",
            &server,
            &key,
            &key,
            &key,
            &[
                ("SANDPIT_REPO", std::ffi::OsStr::new(&repo)),
                ("SANDPIT_CONTEXT", e2b_context.path().as_os_str()),
            ],
        );
        (python, js.join().expect("the JavaScript SDK's run"))
    });
    assert_eq!(
        python_checks,
        [
            "built, its log streamed to on_build_logs",
            "Template.exists",
            "its server answers the first request",
            "packages, env, workdir, user and copies",
            "built again unchanged: cached, files not uploaded again",
            "another image refused with the reason",
        ]
    );
    assert_eq!(
        js_checks,
        [
            "built, its log streamed to onBuildLogs",
            "steps, env, workdir and user"
        ]
    );
    rt.block_on(async {
        // The same builds over REST: each E2B template a name like any.
        let (st, t) = api.get("/templates/e2bweb:v1").await;
        assert_eq!((st, t["status"].as_str()), (200, Some("ready")), "{t}");
        assert_eq!(t["spec"]["steps"].as_array().map(Vec::len), Some(7), "{t}");

        // An agent over MCP: list_templates names what it may start (each
        // name:tag once, ready), and create_sandbox starts one.
        use rmcp::model::CallToolRequestParams;
        use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
        use rmcp::transport::StreamableHttpClientTransport;
        use rmcp::ServiceExt;
        let agent = ()
            .serve(StreamableHttpClientTransport::from_config(
                StreamableHttpClientTransportConfig::with_uri(format!("{}/v1/mcp", server.url))
                    .auth_header(key.clone()),
            ))
            .await
            .unwrap();
        let call = |name: &'static str, args: Value| {
            let params = CallToolRequestParams::new(name)
                .with_arguments(args.as_object().unwrap().clone());
            let agent = &agent;
            async move {
                let r = agent.call_tool(params).await.unwrap();
                assert_ne!(r.is_error, Some(true), "{name}: {r:?}");
                r.structured_content.unwrap()
            }
        };
        let listed = call("list_templates", json!({})).await;
        let mut names: Vec<String> = listed["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| format!("{}:{} {}", t["name"].as_str().unwrap(), t["tag"].as_str().unwrap(), t["status"].as_str().unwrap()))
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["e2bjs:latest ready", "e2bweb:v1 ready", "web:latest ready"],
            "each name:tag once, ready: {listed}"
        );
        let all = call("list_templates", json!({"all_builds": true})).await;
        // Every build: e2bweb:v1 twice, and the Ubuntu one refused
        // (failed at once, saying why, not left waiting).
        let mut builds: Vec<String> = all["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| format!("{} {}", t["name"].as_str().unwrap(), t["status"].as_str().unwrap()))
            .collect();
        builds.sort();
        assert_eq!(
            builds,
            ["bad failed", "e2bjs ready", "e2bweb ready", "e2bweb ready", "web ready"],
            "{all}"
        );
        let (_, bad) = api.get("/templates/bad").await;
        assert!(bad["error"].as_str().unwrap().contains("standard image"), "{bad}");
        let sbx = call("create_sandbox", json!({"template": "e2bweb:v1", "timeout_minutes": 5})).await;
        let id = sbx["id"].as_str().unwrap();
        let run = call(
            "run_command",
            json!({"sandbox_id": id, "command": "pwd; sandpit-hello; curl -s http://127.0.0.1:8000/"}),
        )
        .await;
        assert_eq!(
            run["stdout"],
            "/srv/app\nhello from apt\n<h1>hello from the e2b builder</h1>\n",
            "{run}"
        );
        call("destroy_sandbox", json!({"sandbox_id": id})).await;
        agent.cancel().await.unwrap();
    });

    // Published by the operator: every account may start it.
    server.admin(&["template", "publish", "web", "--account", "builder"]);
    rt.block_on(async {
        let (st, sbx) = create_from(&other, "web").await;
        assert_eq!(st, 201, "{sbx}");
        let id = sbx["id"].as_str().unwrap();
        assert_eq!(
            first_page(&other, id).await,
            "<h1>hello from the template</h1>\n"
        );
    });

    // The page changed: the COPY and what follows run again, the apt and
    // pip steps (and the two before the COPY) come from the cache.
    write_context(context.path(), "<h1>the second build</h1>\n");
    let (code, second_id, log) = template_build(&server, &key, context.path(), &[]);
    assert_eq!(code, 0, "the rebuild failed:\n{log}");
    assert_ne!(second_id, first_id);
    for step in 1..=4 {
        let line = format!("step {step}/6:");
        assert!(
            log.lines()
                .any(|l| l.starts_with(&line) && l.ends_with("(cached)")),
            "step {step} was not cached:\n{log}"
        );
    }
    assert!(
        !log.contains("Unpacking sandpit-hello"),
        "apt ran again:\n{log}"
    );
    assert!(log.contains("4 of 6 steps cached"), "{log}");
    rt.block_on(async {
        let (st, sbx) = create_from(&api, "web:latest").await;
        assert_eq!(st, 201, "{sbx}");
        assert_eq!(sbx["template_id"], second_id.as_str());
        let id = sbx["id"].as_str().unwrap();
        assert_eq!(first_page(&api, id).await, "<h1>the second build</h1>\n");
        assert_eq!(api.sh(id, "sandpit-hello").await, "hello from apt");
    });

    // A ready check that never passes fails the build, with the start
    // command's last lines and the check named; the template stays the
    // last good build.
    let (code, _, log) = template_build(
        &server,
        &key,
        context.path(),
        // Time for Python to start and say so, on a loaded host.
        &["--ready", "false", "--ready-timeout", "20"],
    );
    assert_eq!(code, 1, "{log}");
    assert!(
        log.contains("the ready check (false) did not pass within 20 s"),
        "{log}"
    );
    assert!(
        log.contains("Serving HTTP on"),
        "the start command's output is not in the log:\n{log}"
    );
    // What cannot be built is refused before any VM: here and over REST.
    std::fs::write(
        context.path().join("Dockerfile"),
        "FROM ubuntu:22.04\nRUN true\n",
    )
    .unwrap();
    let (code, _, log) = template_build(&server, &key, context.path(), &[]);
    assert_ne!(code, 0);
    assert!(
        log.contains("line 1: FROM ubuntu:22.04: templates start from the standard image"),
        "{log}"
    );
    rt.block_on(async {
        let (st, body) = api
            .post(
                "/templates",
                json!({"name": "bad", "dockerfile": "FROM sandpit\nVOLUME /x\n"}),
            )
            .await;
        assert_eq!(st, 400, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("VOLUME is not supported"),
            "{body}"
        );
        let (_, t) = api.get("/templates/web").await;
        assert_eq!(
            t["id"],
            second_id.as_str(),
            "a failed build is not the template"
        );
        // A Dockerfile without a start command, over REST: the template is
        // its last step's layer; built again, every step is cached.
        // Built for the other size: its sandboxes have that size.
        let plain = json!({"name": "plain:v1", "size": "medium", "dockerfile": "FROM sandpit\nRUN echo plain > /etc/plain\nENV X=1\n"});
        for round in 0..2 {
            let (st, b) = api.post("/templates", plain.clone()).await;
            assert_eq!(st, 202, "{b}");
            assert_eq!(b["status"], "building");
            let id = b["id"].as_str().unwrap().to_string();
            let built = loop {
                let (_, b) = api.get(&format!("/templates/{id}")).await;
                if b["status"] != "building" {
                    break b;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            };
            assert_eq!(built["status"], "ready", "{built}");
            let log = built["log"].as_str().unwrap();
            if round == 1 {
                assert!(log.contains("the whole template is cached"), "{log}");
                assert_eq!(built["cached_steps"], 2, "{built}");
            }
        }
        // The account holds four templates (web, e2bweb:v1, e2bjs,
        // plain:v1; the refused one failed): a fifth is over its quota,
        // a new build of one it holds is not.
        let (st, body) = api
            .post("/templates", json!({"name": "fifth", "dockerfile": "FROM sandpit\nRUN true\n"}))
            .await;
        assert_eq!(st, 429, "{body}");
        assert!(
            body["error"]["message"].as_str().unwrap().contains("quota is 4 templates"),
            "{body}"
        );
        let (st, sbx) = create_from(&api, "plain:v1").await;
        assert_eq!(st, 201, "{sbx}");
        assert_eq!(sbx["size"], "medium", "{sbx}");
        let id = sbx["id"].as_str().unwrap();
        assert_eq!(api.sh(id, "cat /etc/plain; echo $X; pwd").await, "plain\n1\n/workspace");
        // Its guest has the medium size's memory (1536 MiB, less the
        // kernel's own), not the small one's 1024.
        let kib: u64 = api
            .sh(id, "awk '/MemTotal/ {print $2}' /proc/meminfo")
            .await
            .parse()
            .unwrap();
        assert!(kib > 1200 * 1024, "MemTotal {kib} kB");
        // No build sandbox is left running, and none was billed beyond its
        // seconds: every sandbox but the three made here has ended.
        let (_, list) = api.get("/sandboxes?limit=100").await;
        let running: Vec<&Value> = list["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["status"] == "running")
            .collect();
        assert_eq!(
            running.len(),
            3,
            "build sandboxes were left running: {list}"
        );
    });
    drop(host);
}
