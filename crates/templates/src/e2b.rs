//! E2B's template builder, as its SDKs send it: `Template()…` chained
//! calls become steps (`RUN`, `COPY`, `ENV`, `WORKDIR`, `USER`, each with
//! string `args`) in the body that starts a build
//! (`POST /v2/templates/{id}/builds/{build}`, E2B's `TemplateBuildStartV2`),
//! read here into the same [`Spec`] a Dockerfile makes.
//!
//! What E2B's builder means that a Dockerfile does not:
//! - **It starts as `user` in `/home/user`**, not as root in `/` (E2B's
//!   "user and workdir"), and that directory is then its sandboxes'.
//!   Helpers that need root say so (`apt_install`, `pip_install(g=True)`
//!   send `root` as the step's user).
//! - **pip installs** (`pip_install` runs `pip install --user …`): E2B's
//!   base image lets them; Debian 12's Python refuses them as an
//!   "externally managed environment" unless told otherwise, so builds
//!   from here set `PIP_BREAK_SYSTEM_PACKAGES=1` (kept in its sandboxes,
//!   where an agent's `pip install` then works too).
//! - **A copy names its files by the client's hash** of a whole context
//!   (`filesHash`, over paths, modes and contents), uploaded as a tar
//!   (gzipped by default) of paths relative to the context; the step picks
//!   `src` from it ([`Step::Copy`]'s `src`).

use crate::dockerfile::BASES;
use crate::{Spec, SpecError, Start, State, Step, User};
use serde::Deserialize;
use std::collections::BTreeMap;

/// The images E2B's SDKs name that are Sandpit's standard image:
/// `from_base_image()` (E2B's Debian-based `e2bdev/base`) and
/// `from_debian_image("bookworm")`, besides a Dockerfile's names.
pub const E2B_BASES: &[&str] = &["e2bdev/base", "e2bdev/base:latest"];

/// The body that starts a build (E2B's `TemplateBuildStartV2`). Fields the
/// SDKs add that change nothing here (`forceUpload`, `resolveSymlinks`)
/// are ignored.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildStart {
    #[serde(default)]
    pub from_image: Option<String>,
    #[serde(default)]
    pub from_template: Option<String>,
    #[serde(default)]
    pub from_image_registry: Option<serde_json::Value>,
    #[serde(default)]
    pub force: Option<bool>,
    #[serde(default)]
    pub steps: Vec<BuildStep>,
    #[serde(default)]
    pub start_cmd: Option<String>,
    #[serde(default)]
    pub ready_cmd: Option<String>,
}

/// One instruction (E2B's `TemplateStep`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildStep {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub files_hash: Option<String>,
    #[serde(default)]
    pub force: Option<bool>,
}

/// What E2B's builder starts as (see the module doc).
pub fn initial_state() -> State {
    State {
        user: User::User,
        workdir: "/home/user".into(),
        workdir_set: true,
        env: BTreeMap::from([("PIP_BREAK_SYSTEM_PACKAGES".into(), "1".into())]),
    }
}

/// The build `start` describes, or why Sandpit cannot build it.
pub fn to_spec(start: &BuildStart) -> Result<Spec, SpecError> {
    if let Some(template) = &start.from_template {
        return Err(SpecError::new(format!(
            "from_template({template:?}): a Sandpit template starts from the standard image \
             (from_base_image() or from_debian_image(\"bookworm\")); building on another \
             template is not supported yet"
        )));
    }
    if start.from_image_registry.is_some() {
        return Err(SpecError::new(
            "images from a registry cannot be built: a Sandpit template starts from the \
             standard image (from_base_image() or from_debian_image(\"bookworm\"))",
        ));
    }
    if let Some(image) = &start.from_image {
        check_base(image)?;
    }
    let mut spec = Spec {
        initial: Some(initial_state()),
        ..Spec::default()
    };
    for (i, step) in start.steps.iter().enumerate() {
        let n = i + 1;
        let at = |e: SpecError| SpecError::new(format!("step {n} ({}): {}", step.kind, e.0));
        spec.steps.push(to_step(step).map_err(at)?);
        if step.force == Some(true) && spec.force_from.is_none() {
            spec.force_from = Some(i);
        }
    }
    if start.force == Some(true) {
        spec.force_from = Some(0);
    }
    let nonempty = |s: &Option<String>| s.clone().filter(|c| !c.trim().is_empty());
    spec.start = match (nonempty(&start.start_cmd), nonempty(&start.ready_cmd)) {
        (Some(command), ready) => Some(Start { command, ready }),
        (None, Some(_)) => {
            return Err(SpecError::new(
                "a ready command without a start command: there is nothing to wait for \
                 (set_start_cmd(cmd, ready_cmd))",
            ))
        }
        (None, None) => None,
    };
    spec.check()?;
    Ok(spec)
}

fn check_base(image: &str) -> Result<(), SpecError> {
    if BASES.contains(&image) || E2B_BASES.contains(&image) {
        return Ok(());
    }
    let hint = if image.starts_with("debian:") {
        " (Debian 12, bookworm: from_debian_image(\"bookworm\"))"
    } else {
        ""
    };
    Err(SpecError::new(format!(
        "from image {image:?}: a Sandpit template starts from the standard image{hint}: \
         from_base_image() or from_debian_image(\"bookworm\")"
    )))
}

fn arg(step: &BuildStep, i: usize) -> Option<&str> {
    step.args
        .get(i)
        .map(String::as_str)
        .filter(|a| !a.is_empty())
}

fn to_step(step: &BuildStep) -> Result<Step, SpecError> {
    let first = || arg(step, 0).ok_or_else(|| SpecError::new("its first argument is missing"));
    let user = |i| arg(step, i).map(User::parse).transpose();
    Ok(match step.kind.as_str() {
        "RUN" => Step::Run {
            command: first()?.to_string(),
            user: user(1)?,
        },
        "COPY" => {
            let files = step
                .files_hash
                .clone()
                .ok_or_else(|| SpecError::new("it names no files (filesHash)"))?;
            let dest = arg(step, 1).ok_or_else(|| SpecError::new("it has no destination"))?;
            let mode = arg(step, 3)
                .map(|m| {
                    u32::from_str_radix(m, 8)
                        .map_err(|_| SpecError::new(format!("mode {m:?} is not octal")))
                })
                .transpose()?;
            Step::Copy {
                files: files.to_ascii_lowercase(),
                src: Some(first()?.to_string()),
                dest: dest.to_string(),
                user: user(2)?,
                mode,
            }
        }
        "ENV" => {
            if !step.args.len().is_multiple_of(2) {
                return Err(SpecError::new("its arguments are not name, value pairs"));
            }
            Step::Env {
                vars: step
                    .args
                    .chunks(2)
                    .map(|kv| (kv[0].clone(), kv[1].clone()))
                    .collect(),
            }
        }
        "WORKDIR" => Step::Workdir {
            path: first()?.to_string(),
        },
        "USER" => Step::User {
            user: User::parse(first()?)?,
        },
        other => {
            return Err(SpecError::new(format!(
                "{other:?} is not a step Sandpit builds (RUN, COPY, ENV, WORKDIR, USER)"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(kind: &str, args: &[&str]) -> BuildStep {
        BuildStep {
            kind: kind.into(),
            args: args.iter().map(|a| a.to_string()).collect(),
            ..BuildStep::default()
        }
    }

    /// What the Python SDK sends for `Template().from_base_image()
    /// .apt_install("jq").pip_install("flask").copy("site/", "/srv/site/",
    /// mode=0o644).set_envs({"A": "1"}).set_workdir("/srv/site")
    /// .set_user("user").set_start_cmd("python3 -m http.server",
    /// wait_for_port(8000))`.
    fn sdk_body() -> BuildStart {
        serde_json::from_value(serde_json::json!({
            "fromImage": "e2bdev/base",
            "force": false,
            "steps": [
                {"type": "RUN", "args": ["apt-get update && apt-get install -y jq", "root"], "force": false},
                {"type": "RUN", "args": ["pip install --user flask"], "force": false},
                {"type": "COPY", "args": ["site/", "/srv/site/", "", "0644"], "force": false,
                 "filesHash": "AB".repeat(32), "forceUpload": null},
                {"type": "ENV", "args": ["A", "1"], "force": false},
                {"type": "WORKDIR", "args": ["/srv/site"], "force": false},
                {"type": "USER", "args": ["user"], "force": false},
            ],
            "startCmd": "python3 -m http.server",
            "readyCmd": "[ -n \"$(ss -Htuln sport = :8000)\" ]",
        }))
        .unwrap()
    }

    #[test]
    fn the_sdks_steps_become_a_spec_that_starts_as_e2bs_user() {
        let spec = to_spec(&sdk_body()).unwrap();
        assert_eq!(spec.steps.len(), 6);
        assert_eq!(
            spec.steps[0],
            Step::Run {
                command: "apt-get update && apt-get install -y jq".into(),
                user: Some(User::Root)
            }
        );
        assert!(matches!(&spec.steps[1], Step::Run { user: None, .. }));
        assert_eq!(
            spec.steps[2],
            Step::Copy {
                files: "ab".repeat(32),
                src: Some("site/".into()),
                dest: "/srv/site/".into(),
                user: None,
                mode: Some(0o644)
            }
        );
        let states = spec.states();
        assert_eq!(states[0].user, User::User, "E2B starts as user");
        assert_eq!(states[0].workdir, "/home/user");
        assert_eq!(states[0].env["PIP_BREAK_SYSTEM_PACKAGES"], "1");
        let last = states.last().unwrap();
        assert_eq!(
            (last.workdir.as_str(), last.env["A"].as_str()),
            ("/srv/site", "1")
        );
        let start = spec.start.unwrap();
        assert_eq!(start.command, "python3 -m http.server");
        assert!(start.ready.unwrap().contains("sport = :8000"));
        assert_eq!(spec.force_from, None);
    }

    #[test]
    fn e2bs_start_is_another_cache_than_a_dockerfiles() {
        let e2b = to_spec(&sdk_body()).unwrap();
        let docker = Spec {
            initial: None,
            ..e2b.clone()
        };
        assert_ne!(e2b.layer_keys("small")[0], docker.layer_keys("small")[0]);
    }

    #[test]
    fn skip_cache_forces_from_its_step_and_force_from_the_first() {
        let mut body = sdk_body();
        body.steps[3].force = Some(true);
        body.steps[4].force = Some(true);
        assert_eq!(to_spec(&body).unwrap().force_from, Some(3));
        body.force = Some(true);
        assert_eq!(to_spec(&body).unwrap().force_from, Some(0));
    }

    #[test]
    fn what_sandpit_cannot_build_is_refused_with_the_reason() {
        let refused = |f: &dyn Fn(&mut BuildStart)| {
            let mut body = sdk_body();
            f(&mut body);
            to_spec(&body).unwrap_err().0
        };
        let e = refused(&|b| b.from_image = Some("ubuntu:24.04".into()));
        assert!(e.contains("standard image"), "{e}");
        let e = refused(&|b| b.from_image = Some("debian:stable".into()));
        assert!(e.contains("bookworm"), "{e}");
        let e = refused(&|b| b.from_template = Some("other".into()));
        assert!(e.contains("another template"), "{e}");
        let e = refused(&|b| b.steps.push(step("ADD", &["x"])));
        assert!(e.contains("step 7 (ADD)"), "{e}");
        let e = refused(&|b| b.steps.push(step("USER", &["guest"])));
        assert!(e.contains("root or user"), "{e}");
        let e = refused(&|b| b.steps.push(step("ENV", &["A"])));
        assert!(e.contains("pairs"), "{e}");
        let e = refused(&|b| b.steps[2].args[0] = "../secret".into());
        assert!(e.contains("inside the build context"), "{e}");
        let e = refused(&|b| b.steps[2].files_hash = None);
        assert!(e.contains("filesHash"), "{e}");
        let e = refused(&|b| b.steps[2].args[3] = "rwx".into());
        assert!(e.contains("octal"), "{e}");
        let e = refused(&|b| b.start_cmd = None);
        assert!(e.contains("nothing to wait for"), "{e}");
        for ok in ["debian:bookworm", "e2bdev/base:latest", "sandpit"] {
            let mut body = sdk_body();
            body.from_image = Some(ok.into());
            assert!(to_spec(&body).is_ok(), "{ok}");
        }
    }
}
