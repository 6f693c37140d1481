//! The Dockerfile subset a template can be described in: `FROM` the
//! standard image only, `RUN`, `COPY`, `ENV`, `WORKDIR`, `USER`, `ARG`,
//! `CMD` or `ENTRYPOINT` as the start command, `HEALTHCHECK CMD` as its
//! ready check; `EXPOSE`, `LABEL` and `MAINTAINER` are metadata and noted.
//! Anything else is refused with the line and the reason, before a VM
//! starts.
//!
//! `COPY` names files on the machine that sends the build: [`parse`] gives
//! each as a [`CopyRequest`] (its sources, relative to the build's context
//! directory, and its destination resolved against `WORKDIR`), and the
//! caller packs them into an archive whose hash goes into the step
//! ([`Dockerfile::into_spec`]).

use crate::spec::{check_variable, resolve, Spec, SpecError, Start, State, Step, User};
use std::collections::BTreeMap;

/// The images a template may start from: the standard guest image, by the
/// names a Dockerfile would give it.
pub const BASES: &[&str] = &[
    "debian:bookworm",
    "debian:bookworm-slim",
    "debian:12",
    "sandpit",
];

/// What one `COPY` asks for, for the caller to pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyRequest {
    /// Paths relative to the context directory (never absolute, never
    /// above it).
    pub sources: Vec<String>,
    /// As written: a destination ending in `/` (or any with several
    /// sources) is a directory the sources go into; else a single source
    /// is copied to that name.
    pub dest: String,
    /// `dest` resolved against the working directory at that point.
    pub dest_resolved: String,
    pub user: Option<User>,
    pub mode: Option<u32>,
}

/// A parsed Dockerfile: its steps, a placeholder in each `COPY` step until
/// the caller packs its files, and the start command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dockerfile {
    pub spec: Spec,
    /// One per `COPY` step, in order.
    pub copies: Vec<CopyRequest>,
    /// What was read and left aside (`EXPOSE 8000`, a label): said to the
    /// user, not built.
    pub notes: Vec<String>,
}

impl Dockerfile {
    /// The spec, each `COPY` step naming its packed archive: `files[i]` is
    /// the SHA-256 of `copies[i]`'s, unpacked into its `dest` directory.
    pub fn into_spec(self, packed: &[PackedCopy]) -> Result<Spec, SpecError> {
        let mut spec = self.spec;
        let mut packed = packed.iter();
        for step in &mut spec.steps {
            if let Step::Copy { files, dest, .. } = step {
                let p = packed
                    .next()
                    .ok_or_else(|| SpecError::new("a COPY was not packed"))?;
                *files = p.files.clone();
                *dest = p.dir.clone();
            }
        }
        spec.check()?;
        Ok(spec)
    }
}

/// A `COPY`'s files as packed: the archive's SHA-256, and the directory it
/// unpacks into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedCopy {
    pub files: String,
    pub dir: String,
}

/// Reads `text` with `args` for its `ARG`s (`--build-arg`).
pub fn parse(text: &str, args: &BTreeMap<String, String>) -> Result<Dockerfile, SpecError> {
    let mut spec = Spec::default();
    let mut copies = Vec::new();
    let mut notes = Vec::new();
    let mut state = State::default();
    // ARG values in scope, then ENV: both are substituted in the
    // instructions Docker substitutes (not in RUN, whose shell sees ENV).
    let mut arg_values: BTreeMap<String, String> = BTreeMap::new();
    let mut globals: BTreeMap<String, String> = BTreeMap::new();
    let mut seen_from = false;
    let mut start: Option<String> = None;
    let mut entrypoint: Option<String> = None;
    let mut ready: Option<String> = None;
    for (line, instruction) in logical_lines(text) {
        let fail = |e: SpecError| e.at_line(line);
        let (word, rest) = match instruction.split_once(char::is_whitespace) {
            Some((w, r)) => (w.to_ascii_uppercase(), r.trim().to_string()),
            None => (instruction.to_ascii_uppercase(), String::new()),
        };
        let vars = || {
            let mut v = arg_values.clone();
            v.extend(state.env.clone());
            v
        };
        if !seen_from && word != "FROM" && word != "ARG" {
            return Err(fail(SpecError::new(format!(
                "{word} before FROM: a Dockerfile starts with FROM"
            ))));
        }
        match word.as_str() {
            "FROM" => {
                if seen_from {
                    return Err(fail(SpecError::new(
                        "a second FROM: multi-stage builds are not supported",
                    )));
                }
                seen_from = true;
                let image = substitute(&rest, &arg_values).map_err(fail)?;
                // An ARG before FROM is FROM's alone; one declared again
                // after it (without a value) takes that value.
                globals = std::mem::take(&mut arg_values);
                let image = image.split_whitespace().next().unwrap_or_default();
                if !BASES.contains(&image) {
                    return Err(fail(SpecError::new(format!(
                        "FROM {image}: templates start from the standard image ({}); \
                         install what you need with RUN",
                        BASES.join(", ")
                    ))));
                }
            }
            "ARG" => {
                for word in split_words(&rest).map_err(fail)? {
                    let (name, default) = match word.split_once('=') {
                        Some((n, d)) => (n.to_string(), Some(d.to_string())),
                        None => (word.clone(), None),
                    };
                    check_variable(&name, "").map_err(|e| fail(SpecError::new(e)))?;
                    let global = globals.get(&name).cloned();
                    if let Some(value) = args.get(&name).cloned().or(default).or(global) {
                        arg_values.insert(name, value);
                    }
                }
            }
            "RUN" => {
                if rest.starts_with("--") {
                    return Err(fail(SpecError::new(format!(
                        "RUN {}: RUN's options are not supported",
                        rest.split_whitespace().next().unwrap_or_default()
                    ))));
                }
                let command = shell_or_exec(&rest).map_err(fail)?;
                // A RUN sees the ARGs as variables, as in Docker.
                let command = with_args(&arg_values, &state.env, command);
                spec.steps.push(Step::Run {
                    command,
                    user: None,
                });
            }
            "COPY" | "ADD" => {
                if word == "ADD" {
                    return Err(fail(SpecError::new(
                        "ADD is not supported (it fetches URLs and unpacks archives): use COPY, \
                         or RUN curl",
                    )));
                }
                let mut words = match json_array(&rest) {
                    Some(w) => w,
                    None => {
                        split_words(&substitute(&rest, &vars()).map_err(fail)?).map_err(fail)?
                    }
                };
                let (mut user, mut mode) = (None, None);
                while words.first().is_some_and(|w| w.starts_with("--")) {
                    let flag = words.remove(0);
                    if let Some(owner) = flag.strip_prefix("--chown=") {
                        user = Some(User::parse(owner).map_err(fail)?);
                    } else if let Some(m) = flag.strip_prefix("--chmod=") {
                        mode = Some(u32::from_str_radix(m, 8).map_err(|_| {
                            fail(SpecError::new(format!("--chmod={m} is not an octal mode")))
                        })?);
                    } else {
                        return Err(fail(SpecError::new(format!(
                            "COPY {flag}: only --chown and --chmod are supported"
                        ))));
                    }
                }
                if words.len() < 2 {
                    return Err(fail(SpecError::new(
                        "COPY needs a source and a destination",
                    )));
                }
                let dest = words.pop().unwrap_or_default();
                for source in &words {
                    if source.starts_with('/') || source.split('/').any(|p| p == "..") {
                        return Err(fail(SpecError::new(format!(
                            "COPY {source}: sources are relative to the build's context \
                             directory, and stay inside it"
                        ))));
                    }
                }
                let dest_resolved = resolve(&state.workdir, &dest);
                spec.steps.push(Step::Copy {
                    files: String::new(),
                    src: None,
                    dest: dest_resolved.clone(),
                    user,
                    mode,
                });
                copies.push(CopyRequest {
                    sources: words,
                    dest,
                    dest_resolved,
                    user,
                    mode,
                });
            }
            "ENV" => {
                let first = rest.split_whitespace().next().unwrap_or_default();
                let mut set = BTreeMap::new();
                if !first.contains('=') {
                    // The legacy form: `ENV NAME the whole value`.
                    let value = rest[first.len()..].trim();
                    if first.is_empty() || value.is_empty() {
                        return Err(fail(SpecError::new("ENV NAME=value (or ENV NAME value)")));
                    }
                    set.insert(first.to_string(), substitute(value, &vars()).map_err(fail)?);
                } else {
                    for w in substitute_words(&rest, &vars()).map_err(fail)? {
                        let (k, v) = w.split_once('=').ok_or_else(|| {
                            fail(SpecError::new(format!("ENV {w}: expected NAME=value")))
                        })?;
                        set.insert(k.to_string(), v.to_string());
                    }
                }
                for (k, v) in &set {
                    check_variable(k, v).map_err(|e| fail(SpecError::new(e)))?;
                    state.env.insert(k.clone(), v.clone());
                }
                spec.steps.push(Step::Env { vars: set });
            }
            "WORKDIR" => {
                let path = substitute(&rest, &vars()).map_err(fail)?;
                if path.is_empty() {
                    return Err(fail(SpecError::new("WORKDIR needs a path")));
                }
                state.workdir = resolve(&state.workdir, &path);
                spec.steps.push(Step::Workdir {
                    path: state.workdir.clone(),
                });
            }
            "USER" => {
                let user = User::parse(&substitute(&rest, &vars()).map_err(fail)?).map_err(fail)?;
                state.user = user;
                spec.steps.push(Step::User { user });
            }
            "CMD" => start = Some(shell_or_exec(&rest).map_err(fail)?),
            "ENTRYPOINT" => entrypoint = Some(shell_or_exec(&rest).map_err(fail)?),
            "HEALTHCHECK" => {
                let mut words = rest.splitn(2, char::is_whitespace);
                let first = words.next().unwrap_or_default();
                if first.eq_ignore_ascii_case("NONE") {
                    ready = None;
                } else if first.starts_with("--") {
                    return Err(fail(SpecError::new(
                        "HEALTHCHECK's options are not supported: the ready check runs until it \
                         passes, within the build's timeout",
                    )));
                } else if first.eq_ignore_ascii_case("CMD") {
                    ready =
                        Some(shell_or_exec(words.next().unwrap_or_default().trim()).map_err(fail)?);
                } else {
                    return Err(fail(SpecError::new("HEALTHCHECK CMD command, or NONE")));
                }
            }
            "EXPOSE" | "LABEL" | "MAINTAINER" => {
                notes.push(format!("line {line}: {word} {rest} is not used"))
            }
            other => {
                return Err(fail(SpecError::new(format!(
                    "{other} is not supported (supported: FROM, RUN, COPY, ENV, WORKDIR, USER, \
                     ARG, CMD, ENTRYPOINT, HEALTHCHECK, EXPOSE, LABEL)"
                ))))
            }
        }
    }
    if !seen_from {
        return Err(SpecError::new(
            "no FROM: a Dockerfile starts with FROM sandpit (or debian:bookworm)",
        ));
    }
    // ENTRYPOINT and CMD together: the command is the two, as Docker runs.
    let command = match (entrypoint, start) {
        (Some(e), Some(c)) => Some(format!("{e} {c}")),
        (e, c) => e.or(c),
    };
    spec.start = match (command, ready) {
        (Some(command), ready) => Some(Start { command, ready }),
        (None, Some(_)) => {
            return Err(SpecError::new(
                "a HEALTHCHECK without CMD or ENTRYPOINT: there is nothing to check",
            ))
        }
        (None, None) => None,
    };
    Ok(Dockerfile {
        spec,
        copies,
        notes,
    })
}

/// Instructions with their first line: comments and blank lines dropped,
/// lines ending in `\` joined.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_none()) {
            continue;
        }
        let (body, continues) = match trimmed.strip_suffix('\\') {
            Some(b) => (b, true),
            None => (trimmed, false),
        };
        let entry = current.get_or_insert_with(|| (i + 1, String::new()));
        if !entry.1.is_empty() && !body.is_empty() {
            entry.1.push(' ');
        }
        entry.1.push_str(body.trim());
        if !continues {
            out.extend(current.take());
        }
    }
    out.extend(current);
    out
}

/// A JSON array of strings (the exec form), if `text` is one.
fn json_array(text: &str) -> Option<Vec<String>> {
    text.trim_start()
        .starts_with('[')
        .then(|| serde_json::from_str::<Vec<String>>(text).ok())
        .flatten()
}

/// A command in shell form (as written) or exec form (its words, quoted
/// for the shell, which then runs them as they are).
fn shell_or_exec(text: &str) -> Result<String, SpecError> {
    let command = match json_array(text) {
        Some(words) if words.is_empty() => return Err(SpecError::new("an empty command")),
        Some(words) => shell_words::join(words),
        None => text.to_string(),
    };
    if command.trim().is_empty() {
        return Err(SpecError::new("an empty command"));
    }
    Ok(command)
}

/// A RUN's command with the ARGs in scope (those no ENV overrides)
/// exported first, as Docker gives them to RUN.
fn with_args(
    args: &BTreeMap<String, String>,
    env: &BTreeMap<String, String>,
    command: String,
) -> String {
    let exported: Vec<String> = args
        .iter()
        .filter(|(k, _)| !env.contains_key(*k))
        .map(|(k, v)| format!("{k}={}", shell_words::quote(v)))
        .collect();
    if exported.is_empty() {
        command
    } else {
        format!("export {}; {command}", exported.join(" "))
    }
}

/// Words as a shell splits them (quotes kept together, removed).
fn split_words(text: &str) -> Result<Vec<String>, SpecError> {
    shell_words::split(text).map_err(|e| SpecError::new(format!("{text:?}: {e}")))
}

/// `$NAME` and `${NAME}` (with `:-default`) replaced from `vars`; an
/// unknown one is empty, as in Docker. `\$` is a literal dollar.
fn substitute(text: &str, vars: &BTreeMap<String, String>) -> Result<String, SpecError> {
    substitute_in(text, vars, false)
}

/// [`substitute`] for text then split into words, which keeps `\$` for
/// the split to unescape.
fn substitute_words(text: &str, vars: &BTreeMap<String, String>) -> Result<Vec<String>, SpecError> {
    split_words(&substitute_in(text, vars, true)?)
}

fn substitute_in(
    text: &str,
    vars: &BTreeMap<String, String>,
    keep_escapes: bool,
) -> Result<String, SpecError> {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'$') => {
                out.push_str(if keep_escapes { "\\$" } else { "$" });
                chars.next();
            }
            '$' if chars.peek() == Some(&'{') => {
                chars.next();
                let mut inner = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(c) => inner.push(c),
                        None => return Err(SpecError::new(format!("{text:?}: an unclosed ${{"))),
                    }
                }
                let (name, default) = match inner.split_once(":-") {
                    Some((n, d)) => (n, Some(d)),
                    None => (inner.as_str(), None),
                };
                match (vars.get(name), default) {
                    (Some(v), _) if !v.is_empty() || default.is_none() => out.push_str(v),
                    (_, Some(d)) => out.push_str(d),
                    (None, None) => {}
                    (Some(_), None) => {}
                }
            }
            '$' if chars
                .peek()
                .is_some_and(|c| c.is_ascii_alphabetic() || *c == '_') =>
            {
                let mut name = String::new();
                while let Some(c) = chars
                    .peek()
                    .copied()
                    .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
                {
                    name.push(c);
                    chars.next();
                }
                out.push_str(vars.get(&name).map(String::as_str).unwrap_or_default());
            }
            c => out.push(c),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_ok(text: &str) -> Dockerfile {
        parse(text, &BTreeMap::new()).unwrap()
    }

    fn refused(text: &str) -> String {
        parse(text, &BTreeMap::new()).unwrap_err().0
    }

    #[test]
    fn a_dockerfile_becomes_its_steps_and_start_command() {
        let d = parse_ok(
            "# a web server\n\
             FROM sandpit\n\
             ARG VERSION=2.3\n\
             RUN apt-get update && \\\n    apt-get install -y --no-install-recommends cowsay\n\
             ENV PORT=8000 GREETING=\"hello there\"\n\
             WORKDIR /srv\n\
             WORKDIR site\n\
             COPY --chmod=644 index.html ./\n\
             COPY [\"a b.txt\", \"notes/\"]\n\
             USER user\n\
             EXPOSE 8000\n\
             CMD [\"python3\", \"-m\", \"http.server\", \"8000\"]\n\
             HEALTHCHECK CMD curl -fs localhost:8000\n",
        );
        let steps = &d.spec.steps;
        assert_eq!(steps.len(), 7);
        assert_eq!(
            steps[0],
            Step::Run {
                command: "export VERSION=2.3; apt-get update && apt-get install -y --no-install-recommends cowsay".into(),
                user: None
            }
        );
        assert_eq!(
            steps[1],
            Step::Env {
                vars: BTreeMap::from([
                    ("GREETING".into(), "hello there".into()),
                    ("PORT".into(), "8000".into())
                ])
            }
        );
        assert_eq!(
            steps[3],
            Step::Workdir {
                path: "/srv/site".into()
            }
        );
        assert_eq!(d.copies.len(), 2);
        assert_eq!(d.copies[0].sources, ["index.html"]);
        assert_eq!(d.copies[0].dest_resolved, "/srv/site");
        assert_eq!(d.copies[0].mode, Some(0o644));
        assert_eq!(d.copies[1].sources, ["a b.txt"]);
        assert_eq!(d.copies[1].dest_resolved, "/srv/site/notes");
        assert_eq!(steps[6], Step::User { user: User::User });
        let start = d.spec.start.clone().unwrap();
        assert_eq!(start.command, "python3 -m http.server 8000");
        assert_eq!(start.ready.as_deref(), Some("curl -fs localhost:8000"));
        assert_eq!(d.notes, ["line 12: EXPOSE 8000 is not used"]);
        // Packed: each COPY names its archive and directory.
        let sha = |c: char| c.to_string().repeat(64);
        let spec = d
            .into_spec(&[
                PackedCopy {
                    files: sha('a'),
                    dir: "/srv/site".into(),
                },
                PackedCopy {
                    files: sha('b'),
                    dir: "/srv/site/notes".into(),
                },
            ])
            .unwrap();
        assert!(matches!(&spec.steps[4], Step::Copy { files, .. } if *files == sha('a')));
    }

    #[test]
    fn args_come_from_the_build_and_reach_the_instructions_docker_substitutes() {
        let args = BTreeMap::from([("DIR".to_string(), "/opt/app".to_string())]);
        let d = parse("ARG BASE=sandpit\nFROM $BASE\nARG DIR\nWORKDIR ${DIR}\nENV HOME_DIR=${DIR:-/x} LIT=\\$DIR\nRUN echo $DIR\n", &args).unwrap();
        assert_eq!(
            d.spec.steps[0],
            Step::Workdir {
                path: "/opt/app".into()
            }
        );
        assert_eq!(
            d.spec.steps[1],
            Step::Env {
                vars: BTreeMap::from([
                    ("HOME_DIR".into(), "/opt/app".into()),
                    ("LIT".into(), "$DIR".into())
                ])
            }
        );
        assert_eq!(
            d.spec.steps[2],
            Step::Run {
                command: "export DIR=/opt/app; echo $DIR".into(),
                user: None
            }
        );
        // An ARG before FROM, declared again, keeps its value.
        let d = parse_ok("ARG V=3\nFROM sandpit\nARG V\nRUN echo $V\n");
        assert_eq!(
            d.spec.steps[0],
            Step::Run {
                command: "export V=3; echo $V".into(),
                user: None
            }
        );
        // ENTRYPOINT and CMD together are one command.
        let d = parse_ok("FROM sandpit\nENTRYPOINT [\"node\"]\nCMD server.js\n");
        assert_eq!(d.spec.start.unwrap().command, "node server.js");
    }

    #[test]
    fn what_cannot_be_built_is_refused_with_its_line_and_reason() {
        assert!(refused("FROM ubuntu:22.04\n")
            .contains("line 1: FROM ubuntu:22.04: templates start from the standard image"));
        assert!(refused("RUN true\n").contains("before FROM"));
        assert!(refused("FROM sandpit\nFROM sandpit\n").contains("line 2: a second FROM"));
        assert!(refused("FROM sandpit\nADD https://x/y.tgz /\n").contains("ADD is not supported"));
        assert!(refused("FROM sandpit\nVOLUME /data\n").contains("line 2: VOLUME is not supported"));
        assert!(refused("FROM sandpit\nUSER www-data\n").contains("root or user"));
        assert!(refused("FROM sandpit\nCOPY ../secret /x\n").contains("stay inside it"));
        assert!(refused("FROM sandpit\nCOPY /etc/passwd /x\n").contains("relative"));
        assert!(
            refused("FROM sandpit\nRUN --mount=type=cache,target=/x true\n").contains("options")
        );
        assert!(refused("FROM sandpit\nHEALTHCHECK CMD true\n").contains("nothing to check"));
        assert!(refused("# nothing\n").contains("no FROM"));
        assert!(refused("FROM sandpit\nENV LONELY\n").contains("ENV NAME=value"));
        assert!(refused("FROM sandpit\nCMD []\n").contains("empty"));
    }

    #[test]
    fn continuation_lines_join_and_comments_between_them_go() {
        let d = parse_ok("FROM sandpit\nRUN a \\\n# inside\n  && b \\\n\n");
        assert_eq!(
            d.spec.steps,
            [Step::Run {
                command: "a && b".into(),
                user: None
            }]
        );
    }
}
