//! A real, throwaway PostgreSQL server for tests (and for `sandpit bench
//! cluster`, which compares a cluster with the embedded process on one
//! machine): Debian's binaries, a cluster made by `initdb` in a temporary
//! directory and run as the `postgres` user (when run as root, as CI does;
//! as the current user otherwise), on a port of its own, with a fresh
//! database for each test.
//!
//! # Why it looks like this
//!
//! * **Nothing of the machine's is used or touched.** Debian's `postgresql`
//!   package may also run a cluster of its own on 5432; the tests never go
//!   near it, so a developer's database is safe and a CI machine needs no
//!   service started.
//! * **One server per test binary, one database per test.** `initdb` takes
//!   about a second; a `CREATE DATABASE` a few milliseconds. Tests stay
//!   independent and can run in parallel.
//! * **It goes when the tests go.** The server is started from a thread
//!   that lives as long as the test process, with `PR_SET_PDEATHSIG` set to
//!   SIGQUIT (PostgreSQL's immediate shutdown), so a finished, panicking or
//!   killed test binary leaves no server behind. Directories of servers
//!   whose test process is gone are removed by the next start.
//! * **A password, not `trust`, on TCP.** The server may listen on more than
//!   the loopback (cluster tests reach it from network namespaces), so TCP
//!   connections authenticate (`scram-sha-256`) with a random password.
//! * **A missing PostgreSQL fails loudly**, naming the package to install,
//!   never skips.

use rand::Rng;
use sqlx::{Connection, Executor, PgConnection};
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long the server may take to accept connections after it starts.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Where the temporary clusters live (their names start with this prefix).
const DIR_PREFIX: &str = "sandpit-pg-";

/// A running PostgreSQL server made for this test process.
#[derive(Debug)]
pub struct Postgres {
    port: u16,
    password: String,
    dir: PathBuf,
    pid: u32,
}

static SHARED: OnceLock<Postgres> = OnceLock::new();

/// The server of this test process, listening on the loopback only; started
/// by the first call.
pub fn shared() -> &'static Postgres {
    SHARED.get_or_init(|| Postgres::start(&[IpAddr::V4(Ipv4Addr::LOCALHOST)]))
}

impl Postgres {
    /// Makes a cluster with `initdb` and starts a server listening on
    /// `listen` (the loopback, and for cluster tests the host's end of their
    /// network namespaces' links). Panics, saying what to install or what
    /// the server logged, if it cannot.
    pub fn start(listen: &[IpAddr]) -> Postgres {
        let bin = bin_dir();
        remove_stale_clusters();
        let run_as = run_as();
        let dir = tempfile::Builder::new()
            .prefix(DIR_PREFIX)
            .tempdir_in(std::env::temp_dir())
            .expect("a temporary directory for PostgreSQL")
            .keep();
        std::fs::write(dir.join("owner.pid"), std::process::id().to_string())
            .expect("write owner.pid");
        let password: String = rand::thread_rng()
            .sample_iter(rand::distributions::Alphanumeric)
            .take(24)
            .map(char::from)
            .collect();
        let pwfile = dir.join("pwfile");
        std::fs::write(&pwfile, &password).expect("write the password file");
        let data = dir.join("data");
        let log = dir.join("server.log");
        if let Some((uid, gid)) = run_as {
            chown(&dir, uid, gid);
            chown(&pwfile, uid, gid);
        }

        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-E", "UTF8", "--no-sync"])
            .args(["--auth-local=trust", "--auth-host=scram-sha-256"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .current_dir(&dir);
        let out = as_user(&mut initdb, run_as)
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", bin.join("initdb").display()));
        assert!(
            out.status.success(),
            "initdb failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // TCP connections from anywhere the server listens, with the password.
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\nhost all all 0.0.0.0/0 scram-sha-256\n\
             host all all ::/0 scram-sha-256\n",
        )
        .expect("write pg_hba.conf");

        let port = free_port();
        let listen: Vec<String> = listen.iter().map(IpAddr::to_string).collect();
        let log_file = std::fs::File::create(&log).expect("create server.log");
        if let Some((uid, gid)) = run_as {
            chown(&log, uid, gid);
        }
        let mut server = Command::new(bin.join("postgres"));
        server
            .arg("-D")
            .arg(&data)
            .arg("-p")
            .arg(port.to_string())
            .arg("-k")
            .arg(&dir)
            .arg("-c")
            .arg(format!("listen_addresses={}", listen.join(",")))
            // A test database is thrown away: durability costs only time.
            .args(["-c", "fsync=off", "-c", "synchronous_commit=off"])
            .args(["-c", "full_page_writes=off", "-c", "max_connections=400"])
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("dup server.log"))
            .stderr(log_file);
        as_user(&mut server, run_as);
        // SAFETY: prctl is async-signal-safe and touches only this process.
        unsafe {
            server.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGQUIT) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        // The keeper thread never ends while the test process runs, so the
        // parent-death signal fires only when the process goes.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("postgres-keeper".into())
            .spawn(move || match server.spawn() {
                Ok(mut child) => {
                    let _ = tx.send(Ok(child.id()));
                    let _ = child.wait();
                    // Keep the thread (the child's "parent") alive anyway.
                    loop {
                        std::thread::park();
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            })
            .expect("spawn the postgres keeper thread");
        let pid = rx
            .recv()
            .expect("the keeper thread answers")
            .unwrap_or_else(|e| panic!("start {}: {e}", bin.join("postgres").display()));

        let pg = Postgres {
            port,
            password,
            dir,
            pid,
        };
        pg.wait_ready();
        pg
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The password of the `postgres` role.
    pub fn password(&self) -> &str {
        &self.password
    }

    /// The server's process id (for tests that stop or kill it).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// A URL for `database` through `host` (an address it listens on).
    pub fn url(&self, host: IpAddr, database: &str) -> String {
        let host = match host {
            IpAddr::V4(a) => a.to_string(),
            IpAddr::V6(a) => format!("[{a}]"),
        };
        format!(
            "postgres://postgres:{}@{host}:{}/{database}",
            self.password, self.port
        )
    }

    /// Creates a new, empty database and returns its URL over the
    /// loopback.
    pub async fn fresh_database(&self) -> String {
        let name = format!(
            "t_{}",
            rand::thread_rng()
                .sample_iter(rand::distributions::Alphanumeric)
                .take(16)
                .map(|c| char::from(c).to_ascii_lowercase())
                .collect::<String>()
        );
        let admin = self.url(IpAddr::V4(Ipv4Addr::LOCALHOST), "postgres");
        let mut conn = PgConnection::connect(&admin)
            .await
            .unwrap_or_else(|e| panic!("connect to the test PostgreSQL: {e}"));
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {e}"));
        let _ = conn.close().await;
        self.url(IpAddr::V4(Ipv4Addr::LOCALHOST), &name)
    }

    /// What the server logged so far (for a failing test's message).
    pub fn log(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(self.dir.join("server.log")) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + START_TIMEOUT;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
                && self.dir.join("data").join("postmaster.pid").exists()
            {
                // Accepting TCP is not yet accepting sessions (the startup
                // process may still run): a real query decides.
                let url = self.url(IpAddr::V4(Ipv4Addr::LOCALHOST), "postgres");
                let ok = std::thread::spawn(move || {
                    let rt = tokio_rt();
                    rt.block_on(async {
                        match PgConnection::connect(&url).await {
                            Ok(c) => {
                                let _ = c.close().await;
                                true
                            }
                            Err(_) => false,
                        }
                    })
                })
                .join()
                .unwrap_or(false);
                if ok {
                    return;
                }
            }
            if !Path::new(&format!("/proc/{}", self.pid)).exists() {
                panic!("PostgreSQL exited at start; its log:\n{}", self.log());
            }
            if Instant::now() > deadline {
                panic!(
                    "PostgreSQL did not accept connections within {START_TIMEOUT:?}; its log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A current-thread runtime for the readiness probe (the caller may be in
/// a runtime of its own or in none).
fn tokio_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Debian's PostgreSQL binaries (`/usr/lib/postgresql/<version>/bin`, the
/// newest installed), or `SANDPIT_PG_BIN` if set.
fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SANDPIT_PG_BIN") {
        return PathBuf::from(dir);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    match versions.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): \
             run scripts/install-deps.sh, or apt-get install postgresql"
        ),
    }
}

/// The uid and gid to run the server as: `postgres`'s when running as root
/// (PostgreSQL refuses to run as root), none (the current user) otherwise.
fn run_as() -> Option<(u32, u32)> {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let name = std::ffi::CString::new("postgres").expect("no NUL");
    // SAFETY: getpwnam returns a pointer to static storage or null; the
    // fields are read at once, before any other call could overwrite it.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    assert!(
        !pw.is_null(),
        "there is no postgres user to run the test PostgreSQL as \
         (apt-get install postgresql makes it)"
    );
    // SAFETY: pw is not null (checked above).
    unsafe { Some(((*pw).pw_uid, (*pw).pw_gid)) }
}

fn as_user(cmd: &mut Command, run_as: Option<(u32, u32)>) -> &mut Command {
    if let Some((uid, gid)) = run_as {
        cmd.uid(uid)
            .gid(gid)
            .env("HOME", "/tmp")
            .env_remove("PGDATA");
    }
    cmd
}

fn chown(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(gid))
        .unwrap_or_else(|e| panic!("chown {}: {e}", path.display()));
}

/// A port nothing listens on now (the server binds it a moment later).
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Removes the clusters of test processes that are gone (their servers
/// went with them, see the module docs).
fn remove_stale_clusters() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        if !name.to_string_lossy().starts_with(DIR_PREFIX) {
            continue;
        }
        let owner = std::fs::read_to_string(e.path().join("owner.pid")).unwrap_or_default();
        let alive = owner
            .trim()
            .parse::<u32>()
            .is_ok_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        let server_alive = std::fs::read_to_string(e.path().join("data/postmaster.pid"))
            .ok()
            .and_then(|s| s.lines().next().and_then(|l| l.trim().parse::<u32>().ok()))
            .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        if !alive && !server_alive {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}
