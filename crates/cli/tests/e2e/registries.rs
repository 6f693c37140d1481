//! Package registries from behind an operator's proxy, for real: with the
//! host's extra CA certificates (every file in
//! `/usr/local/share/ca-certificates/`, where a TLS-inspecting network's CA
//! goes) and an HTTP proxy in `[network]`, the guest's user runs
//! `pip download` and `npm view` against pypi.org and registry.npmjs.org,
//! and the proxy sees their CONNECTs.
//!
//! The proxy is the test's own, on a private address (denied to guests, as a
//! corporate proxy's usually is) of a network namespace: its listening
//! socket is bound inside the namespace, while its connections out to the
//! registries leave from the host's, which reaches them. It tunnels to the
//! registries only. This test needs the registries: where the host cannot
//! reach them, it fails and says so.

use crate::common::netns::TestHost;
use crate::common::*;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PROXY_HOST_SIDE: &str = "172.30.253.1";
const PROXY: &str = "172.30.253.2";
const PROXY_PORT: u16 = 3128;
/// Another port of the proxy's address, which the guest must not reach.
const OTHER_PORT: u16 = 3129;

/// What the proxy tunnels to; anything else is refused.
const REGISTRIES: &[&str] = &["pypi.org", "files.pythonhosted.org", "registry.npmjs.org"];

/// Every file in the host's directory of extra CAs.
fn host_extra_cas() -> Vec<PathBuf> {
    fn walk(dir: &std::path::Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    let dir = std::path::Path::new("/usr/local/share/ca-certificates");
    if dir.is_dir() {
        walk(dir, &mut out);
    }
    out.sort();
    out
}

/// The host reaches every registry (or the test cannot say anything).
fn assert_registries_reachable() {
    for host in REGISTRIES {
        let reached = std::net::ToSocketAddrs::to_socket_addrs(&(*host, 443))
            .map_err(|e| e.to_string())
            .and_then(|mut addrs| {
                let a = addrs.next().ok_or("no address")?;
                std::net::TcpStream::connect_timeout(&a, Duration::from_secs(15))
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = reached {
            panic!(
                "this host cannot reach {host}:443 ({e}): this test downloads from the real \
                 package registries (pypi.org, files.pythonhosted.org, registry.npmjs.org) \
                 and needs them reachable from the host"
            );
        }
    }
}

/// Listeners bound inside `netns` (by a thread that enters it and ends), so
/// they accept connections there while everything else stays in the host's.
fn listen_in(netns: &std::path::Path, ports: &[u16]) -> Vec<std::net::TcpListener> {
    let netns = netns.to_path_buf();
    let ports = ports.to_vec();
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&netns).expect("the test namespace");
        // SAFETY: setns on this thread only, which ends after binding.
        let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
        ports
            .iter()
            .map(|p| std::net::TcpListener::bind((PROXY, *p)).expect("binding in the namespace"))
            .collect()
    })
    .join()
    .unwrap()
}

/// A CONNECT-only proxy to the registries, recording each request line.
async fn serve_proxy(listener: tokio::net::TcpListener, seen: Arc<Mutex<Vec<String>>>) {
    loop {
        let Ok((mut client, _)) = listener.accept().await else {
            return;
        };
        let seen = seen.clone();
        tokio::spawn(async move {
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                match client.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let line = String::from_utf8_lossy(&head)
                .lines()
                .next()
                .unwrap_or_default()
                .to_string();
            seen.lock().unwrap().push(line.clone());
            let target = line
                .strip_prefix("CONNECT ")
                .and_then(|l| l.split(' ').next())
                .and_then(|t| t.rsplit_once(':'))
                .filter(|(h, p)| REGISTRIES.contains(h) && *p == "443");
            let Some((host, _)) = target else {
                let _ = client.write_all(b"HTTP/1.1 403 Forbidden\r\n\r\n").await;
                return;
            };
            // From the host's namespace (this task's thread), which reaches
            // the registries.
            let Ok(mut upstream) = tokio::net::TcpStream::connect((host, 443)).await else {
                let _ = client.write_all(b"HTTP/1.1 502 Bad Gateway\r\n\r\n").await;
                return;
            };
            if client
                .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .await
                .is_ok()
            {
                let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
            }
        });
    }
}

/// `c` with its CA files replaced by one self-signed certificate of its own.
fn with_other_ca(c: &sandpit_runtime::RuntimeConfig) -> sandpit_runtime::RuntimeConfig {
    let cert = rcgen::generate_simple_self_signed(vec!["other.example".into()])
        .unwrap()
        .cert;
    let file = c.data_dir.join("other-ca.pem");
    std::fs::write(&file, cert.pem()).unwrap();
    let mut other = c.clone();
    other.network.ca_certificates = vec![file];
    other
}

#[test]
fn pip_and_npm_reach_the_registries_through_the_operators_proxy() {
    assert_registries_reachable();
    let cas = host_extra_cas();
    eprintln!("the host's extra CA certificates: {cas:?}");
    let pems = sandpit_runtime::vm::net::read_ca_certificates(&cas).unwrap();

    let proxy_host = TestHost::start("px", PROXY_HOST_SIDE, PROXY);
    let mut listeners = listen_in(&proxy_host.netns_path(), &[PROXY_PORT, OTHER_PORT]);
    let other = listeners.pop().unwrap();
    let proxy = listeners.pop().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let other_hits = Arc::new(Mutex::new(0usize));

    let dir = data_dir();
    let mut c = config(&dir);
    c.network.proxy = Some(format!("http://{PROXY}:{PROXY_PORT}"));
    c.network.no_proxy = vec![".internal.example".into()];
    c.network.ca_certificates = cas.clone();
    // A cold-booted VM of these settings...
    let s = shared("sbx_registries", || c.clone());
    s.rt.block_on(async {
        proxy.set_nonblocking(true).unwrap();
        other.set_nonblocking(true).unwrap();
        tokio::spawn(serve_proxy(
            tokio::net::TcpListener::from_std(proxy).unwrap(),
            seen.clone(),
        ));
        let other = tokio::net::TcpListener::from_std(other).unwrap();
        let hits = other_hits.clone();
        tokio::spawn(async move {
            while other.accept().await.is_ok() {
                *hits.lock().unwrap() += 1;
            }
        });

        // ...and one restored from their template: the settings are part of
        // the template's key, and a restored VM has them.
        s.manager.ensure_template("small").await.expect("template");
        let mut without_proxy = c.clone();
        without_proxy.network.proxy = None;
        for (what, other) in [
            ("without the proxy", without_proxy),
            ("with another CA", with_other_ca(&c)),
        ] {
            assert!(
                manager_with(other).template("small").is_none(),
                "a manager {what} found the template of these settings"
            );
        }
        let restored = s.manager.create(new_vm("sbx_registries2")).await.unwrap();
        assert!(restored.record.template.is_some(), "restored from the template");
        assert!(s.vm.record.template.is_none(), "booted cold");

        let bundle = "/etc/ssl/certs/ca-certificates.crt";
        let ca_vars = if pems.is_empty() {
            String::new()
        } else {
            format!(" {bundle} {bundle} {bundle} {bundle}")
        };
        for vm in [&s.vm, &restored] {
            let env = sh(
                vm,
                "echo \"$https_proxy $HTTP_PROXY $no_proxy \
                 $SSL_CERT_FILE $REQUESTS_CA_BUNDLE $PIP_CERT $NODE_EXTRA_CA_CERTS\"",
            )
            .await;
            assert_eq!(
                env.trim_end(),
                format!(
                    "http://{PROXY}:{PROXY_PORT} http://{PROXY}:{PROXY_PORT} \
                     localhost,127.0.0.1,::1,.internal.example{ca_vars}"
                )
            );
            // The certificates close the system bundle, each once.
            let (_, text) = vm.agent.read_file(bundle, 16 << 20).await.unwrap();
            let text = String::from_utf8(text).unwrap();
            assert!(text.ends_with(&pems.concat()), "{bundle} lacks the CAs");
            for pem in &pems {
                assert_eq!(text.matches(pem.as_str()).count(), 1);
            }
        }

        let out = run(
            &restored,
            req_timeout(
                "whoami && pip download --no-deps --no-cache-dir -d /tmp/x six==1.16.0 && ls /tmp/x",
                600_000,
            ),
        )
        .await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.result.exit_code == Some(0) && stdout.contains("six-1.16.0-py2.py3-none-any.whl"),
            "pip download failed: {:?}\n{stdout}\n{}",
            out.result,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.starts_with("user\n"), "{stdout}");

        let out = run(&restored, req_timeout("npm view is-number version", 600_000)).await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.result.exit_code == Some(0)
                && stdout.trim().split('.').all(|n| n.parse::<u32>().is_ok()),
            "npm view failed: {:?}\n{stdout}\n{}",
            out.result,
            String::from_utf8_lossy(&out.stderr)
        );

        let seen = seen.lock().unwrap().clone();
        for host in ["pypi.org", "registry.npmjs.org"] {
            assert!(
                seen.iter()
                    .any(|l| l.starts_with(&format!("CONNECT {host}:443 "))),
                "the proxy saw no CONNECT to {host}: {seen:?}"
            );
        }

        // The proxy's address is reachable at its port only.
        let out = run(
            &restored,
            req(&format!(
                "curl --noproxy '*' -sS -m 10 http://{PROXY}:{OTHER_PORT}/"
            )),
        )
        .await;
        assert_ne!(
            out.result.exit_code,
            Some(0),
            "the guest reached another port of the proxy's address"
        );
        assert_eq!(*other_hits.lock().unwrap(), 0, "another port was reached");

        s.manager.destroy(&restored.record.id).await.unwrap();
        s.manager.destroy(&s.vm.record.id).await.unwrap();
    });
    drop(proxy_host);
}
