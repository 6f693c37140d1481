//! A template's steps, what they leave (user, working directory,
//! environment) and the cache keys of the layers they make.

use serde::{Deserialize, Serialize};
use sha2::Digest;
use std::collections::BTreeMap;

/// Steps one template may have.
pub const MAX_STEPS: usize = 100;
/// The longest command (a step's, the start command, the ready check).
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;

/// Why a description is not a template this service can build: said at
/// once, before any VM starts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SpecError(pub String);

impl SpecError {
    pub fn new(message: impl Into<String>) -> SpecError {
        SpecError(message.into())
    }

    /// The same error, said of line `line` of a file.
    pub fn at_line(self, line: usize) -> SpecError {
        SpecError(format!("line {line}: {}", self.0))
    }
}

/// Who a step (or the start command) runs as. The guest has two users:
/// root, and the unprivileged user every sandbox command runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum User {
    Root,
    User,
}

impl User {
    /// A user as a Dockerfile or E2B names it: `root` (or uid 0), `user`
    /// (or its uid, 1000). Any other is refused: the image has no other
    /// login, and a step cannot make one it would then run as.
    pub fn parse(name: &str) -> Result<User, SpecError> {
        // `USER name:group`: the group goes with the user here.
        let name = name.split(':').next().unwrap_or_default();
        match name {
            "root" | "0" => Ok(User::Root),
            "user" | "1000" => Ok(User::User),
            other => Err(SpecError::new(format!(
                "user {other:?} does not exist in the guest: steps run as root or user"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            User::Root => "root",
            User::User => "user",
        }
    }
}

/// One build step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Step {
    /// A shell command (`bash -c`), as `user` when given, else as the
    /// build's current user; the build fails if it exits non-zero.
    Run {
        command: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<User>,
    },
    /// The files of an uploaded archive (a tar, its SHA-256 `files`, laid
    /// out as they are to stand under `dest`) unpacked into directory
    /// `dest`, owned by `user` (default: the build's current user), with
    /// `mode` when given.
    ///
    /// With `src`, the archive is a whole build context instead (paths
    /// relative to the context's directory, maybe gzipped, named by the
    /// client's own hash: E2B's `filesHash`), and what `src` matches in it
    /// (a path or a glob) is copied as Docker's `COPY` does: a directory's
    /// contents into `dest`, a file into `dest` when it ends with `/` or
    /// is a directory, else to `dest` itself.
    Copy {
        files: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        src: Option<String>,
        dest: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        user: Option<User>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mode: Option<u32>,
    },
    /// Variables set for every later step, the start command and every
    /// command of the template's sandboxes.
    Env { vars: BTreeMap<String, String> },
    /// The working directory of every later step, the start command and
    /// (by default) the template's sandboxes' commands; made if missing.
    Workdir { path: String },
    /// Who later steps and the start command run as (the sandboxes'
    /// commands are always the unprivileged user's).
    User { user: User },
}

/// The command a template's sandboxes start with already running, and how
/// the build knows it is ready.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Start {
    pub command: String,
    /// Run until it exits 0; the template is saved then. Without one, the
    /// build waits [`Start::SETTLE_SECS`] and checks the command still runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
}

impl Start {
    /// How long a start command without a ready check is given.
    pub const SETTLE_SECS: u64 = 2;
}

/// A template's whole description.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Spec {
    pub steps: Vec<Step>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<Start>,
    /// Steps from this one on are run again whatever the cache holds
    /// (E2B's `skip_cache`, `force`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub force_from: Option<usize>,
    /// What the first step starts as, when not as a Dockerfile's (root in
    /// `/`): E2B's builder starts as `user` in `/home/user`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial: Option<State>,
}

/// What the steps before a point leave: who runs, where, with what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    pub user: User,
    /// Absolute.
    pub workdir: String,
    /// Whether a step set the working directory (a template's sandboxes
    /// then run their commands there; else in their usual `/workspace`).
    pub workdir_set: bool,
    pub env: BTreeMap<String, String>,
}

impl Default for State {
    /// As a Dockerfile starts: root, in `/`, no variables of its own.
    fn default() -> State {
        State {
            user: User::Root,
            workdir: "/".into(),
            workdir_set: false,
            env: BTreeMap::new(),
        }
    }
}

impl Spec {
    /// Checks what can be checked before a build: sizes, names, paths.
    pub fn check(&self) -> Result<(), SpecError> {
        if self.steps.len() > MAX_STEPS {
            return Err(SpecError::new(format!(
                "{} steps: a template has at most {MAX_STEPS}",
                self.steps.len()
            )));
        }
        let command = |what: &str, c: &str| {
            if c.trim().is_empty() {
                Err(SpecError::new(format!("{what} is empty")))
            } else if c.len() > MAX_COMMAND_BYTES || c.contains('\0') {
                Err(SpecError::new(format!(
                    "{what} is over {MAX_COMMAND_BYTES} bytes or holds a NUL byte"
                )))
            } else {
                Ok(())
            }
        };
        for (i, step) in self.steps.iter().enumerate() {
            let n = i + 1;
            match step {
                Step::Run { command: c, .. } => command(&format!("step {n}'s command"), c)?,
                Step::Copy {
                    files,
                    src,
                    dest,
                    mode,
                    ..
                } => {
                    if files.len() != 64 || !files.bytes().all(|b| b.is_ascii_hexdigit()) {
                        return Err(SpecError::new(format!(
                            "step {n}: files must name an upload by its SHA-256 (64 hex digits)"
                        )));
                    }
                    if let Some(src) = src {
                        check_source(src).map_err(|e| SpecError::new(format!("step {n}: {e}")))?;
                    }
                    check_path(dest).map_err(|e| SpecError::new(format!("step {n}: {e}")))?;
                    if mode.is_some_and(|m| m > 0o7777) {
                        return Err(SpecError::new(format!(
                            "step {n}: mode {:o} is not a file mode",
                            mode.unwrap_or_default()
                        )));
                    }
                }
                Step::Env { vars } => {
                    for (k, v) in vars {
                        check_variable(k, v)
                            .map_err(|e| SpecError::new(format!("step {n}: {e}")))?;
                    }
                }
                Step::Workdir { path } => {
                    check_path(path).map_err(|e| SpecError::new(format!("step {n}: {e}")))?
                }
                Step::User { .. } => {}
            }
        }
        if let Some(start) = &self.start {
            command("the start command", &start.command)?;
            if let Some(ready) = &start.ready {
                command("the ready check", ready)?;
            }
        }
        Ok(())
    }

    /// The state before each step, and last the state after them all (what
    /// the start command and the template's sandboxes get): `steps.len() + 1`
    /// states.
    pub fn states(&self) -> Vec<State> {
        let mut at = self.initial.clone().unwrap_or_default();
        let mut out = vec![at.clone()];
        for step in &self.steps {
            match step {
                Step::Env { vars } => {
                    for (k, v) in vars {
                        at.env.insert(k.clone(), v.clone());
                    }
                }
                Step::Workdir { path } => {
                    at.workdir = resolve(&at.workdir, path);
                    at.workdir_set = true;
                }
                Step::User { user } => at.user = *user,
                Step::Run { .. } | Step::Copy { .. } => {}
            }
            out.push(at.clone());
        }
        out
    }

    /// The cache key of the layer after each step, and last of the saved
    /// template (with its start command running, when it has one):
    /// `steps.len() + 1` keys. Each hashes the key before it with its
    /// step, so a key names every step up to it. `base` names what the
    /// first step starts from (the guest image's standard template of a
    /// size).
    pub fn layer_keys(&self, base: &str) -> Vec<String> {
        let mut key = match &self.initial {
            None => hash(&("base", base)),
            Some(initial) => hash(&("base", base, initial)),
        };
        let mut keys = Vec::with_capacity(self.steps.len() + 1);
        for step in &self.steps {
            key = hash(&("step", &key, step));
            keys.push(key.clone());
        }
        keys.push(hash(&("start", &key, &self.start)));
        keys
    }
}

fn hash<T: Serialize>(value: &T) -> String {
    hex::encode(sha2::Sha256::digest(
        serde_json::to_vec(value).expect("a spec serializes"),
    ))
}

/// `path` from directory `dir`: itself when absolute; `.` and `..` are
/// resolved (never above `/`).
pub fn resolve(dir: &str, path: &str) -> String {
    let mut parts: Vec<&str> = if path.starts_with('/') {
        Vec::new()
    } else {
        dir.split('/').filter(|p| !p.is_empty()).collect()
    };
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    format!("/{}", parts.join("/"))
}

fn check_path(path: &str) -> Result<(), String> {
    if path.is_empty() || path.len() > 4096 || path.contains('\0') {
        Err(format!("{path:?} is not a path"))
    } else {
        Ok(())
    }
}

/// A copy's source in a build context: relative, inside it, a path or a
/// glob (`*`, `?`, `[…]`).
fn check_source(src: &str) -> Result<(), String> {
    if src.is_empty() || src.len() > 4096 || src.contains('\0') {
        return Err(format!("{src:?} is not a source path"));
    }
    if src.starts_with('/') || src.split('/').any(|p| p == "..") {
        return Err(format!(
            "{src:?} is not inside the build context: sources are relative to it"
        ));
    }
    Ok(())
}

/// A variable a step may set: a shell name, a value without NUL.
pub fn check_variable(name: &str, value: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && !name.as_bytes()[0].is_ascii_digit()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !ok {
        return Err(format!(
            "{name:?} is not a variable name (letters, digits, _)"
        ));
    }
    if value.contains('\0') {
        return Err(format!("the value of {name} holds a NUL byte"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(c: &str) -> Step {
        Step::Run {
            command: c.into(),
            user: None,
        }
    }

    #[test]
    fn a_key_names_every_step_up_to_it_and_nothing_after() {
        let a = Spec {
            steps: vec![run("apt-get install -y jq"), run("pip install flask")],
            start: Some(Start {
                command: "python3 -m http.server".into(),
                ready: None,
            }),
            force_from: None,
            initial: None,
        };
        let mut b = a.clone();
        b.steps[1] = run("pip install requests");
        let (ka, kb) = (a.layer_keys("small"), b.layer_keys("small"));
        assert_eq!(ka.len(), 3);
        assert_eq!(
            ka[0], kb[0],
            "the first step is the same: its layer is shared"
        );
        assert_ne!(ka[1], kb[1]);
        assert_ne!(ka[2], kb[2], "the start's save stands on the changed step");
        // Another base (size) shares nothing.
        assert_ne!(a.layer_keys("medium")[0], ka[0]);
        // The same step after a different one is another layer.
        let mut c = a.clone();
        c.steps.insert(0, run("true"));
        assert!(c.layer_keys("small").iter().all(|k| !ka.contains(k)));
        // Without a start command the last save is another.
        let plain = Spec { start: None, ..a }.layer_keys("small");
        assert_eq!(plain.len(), 3);
        assert_eq!(plain[..2], ka[..2]);
        assert_ne!(plain[2], ka[2]);
    }

    #[test]
    fn steps_leave_their_user_directory_and_variables_to_the_next() {
        let spec = Spec {
            steps: vec![
                Step::Env {
                    vars: BTreeMap::from([("A".into(), "1".into())]),
                },
                Step::Workdir {
                    path: "/app".into(),
                },
                Step::Workdir {
                    path: "src/../web".into(),
                },
                Step::User { user: User::User },
                Step::Env {
                    vars: BTreeMap::from([("A".into(), "2".into()), ("B".into(), "x".into())]),
                },
            ],
            ..Spec::default()
        };
        let states = spec.states();
        assert_eq!(states.len(), 6);
        assert_eq!(states[0], State::default());
        assert_eq!(states[0].user, User::Root);
        assert_eq!(states[1].env["A"], "1");
        assert_eq!(states[2].workdir, "/app");
        assert!(states[2].workdir_set && !states[1].workdir_set);
        assert_eq!(states[3].workdir, "/app/web");
        assert_eq!(states[4].user, User::User);
        assert_eq!(states[5].env["A"], "2");
        assert_eq!(states[5].env["B"], "x");
    }

    #[test]
    fn what_cannot_be_built_is_refused_before_a_vm_starts() {
        let bad = |steps: Vec<Step>| {
            Spec {
                steps,
                ..Spec::default()
            }
            .check()
            .unwrap_err()
            .0
        };
        assert!(bad(vec![run("  ")]).contains("empty"));
        assert!(bad(vec![Step::Copy {
            files: "abc".into(),
            src: None,
            dest: "/app".into(),
            user: None,
            mode: None
        }])
        .contains("SHA-256"));
        assert!(bad(vec![Step::Env {
            vars: BTreeMap::from([("1A".into(), "x".into())])
        }])
        .contains("variable name"));
        assert!(bad(vec![run("true"); MAX_STEPS + 1]).contains("at most"));
        assert!(User::parse("www-data")
            .unwrap_err()
            .0
            .contains("root or user"));
        assert_eq!(User::parse("root:root"), Ok(User::Root));
        assert_eq!(User::parse("1000"), Ok(User::User));
    }

    #[test]
    fn paths_resolve_from_the_working_directory_never_above_the_root() {
        assert_eq!(resolve("/", "app"), "/app");
        assert_eq!(resolve("/app", "../../etc"), "/etc");
        assert_eq!(resolve("/app", "/srv/./x/"), "/srv/x");
        assert_eq!(resolve("/app", "."), "/app");
    }
}
