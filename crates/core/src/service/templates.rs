//! Template builds: the steps of a [`Spec`] run in a sandbox of the
//! account's (the build is a sandbox: placed, billed and expired as one),
//! each step that changes the VM saved as a layer, and the last save taken
//! with the start command running and its ready check passed. Sandboxes of
//! the template start from that save (see `create`), their server up.
//!
//! A layer is found again by its key (the hash of its step and of every
//! step before it, `sandpit_templates::Spec::layer_keys`): a rebuild starts
//! from the last layer it finds on a node that can take the build, so
//! only the steps from the first changed one on run again. Layers and
//! templates name saves on their node, which its sweep keeps (see
//! `snapshots::sweep_snapshots`); a replaced or retired one's save goes at
//! the next sweep that finds nothing naming it.
//!
//! The build runs in a task of its own: the caller gets the build
//! `building` at once and follows its log. A build whose server dies stops
//! updating its row and is failed by the reaper ([`STALLED_AFTER`]); its
//! sandbox expires as any does.

use crate::api::{Caller, ReservedBuild, Sandboxes, Templates};
use crate::error::{CoreError, ErrorType, Result};
use crate::model::*;
use crate::service::Service;
use sandpit_host::ids::rfc3339;
use sandpit_host::machines::{Command, Machines};
use sandpit_protocol::ExecRequest;
use sandpit_runtime::GuestExecEvent;
use sandpit_store::{LayerRow, SandboxRow, TemplateRow, TemplateStatus};
use sandpit_templates::{dockerfile, Spec, Start, State, Step, User};
use sha2::Digest;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a build's sandbox lives: every step and the ready check.
const BUILD_MINUTES: u32 = 60;
/// A build that has not said anything for this long is taken for one
/// whose server went away.
pub(super) const STALLED_AFTER: Duration = Duration::from_secs(180);
/// A build asked for whose steps have not come for this long (E2B's
/// builder uploads its files in between) is failed.
pub(super) const WAITING_AFTER: Duration = Duration::from_secs(3600);
/// How often a build says it is alive while a step is quiet.
const HEARTBEAT: Duration = Duration::from_secs(20);
/// Finished builds of a `name:tag` kept; older ones are retired.
const KEEP_BUILDS: usize = 3;
/// How long a ready check may take to pass, unless the build says.
const READY_TIMEOUT: Duration = Duration::from_secs(300);
/// The longest a build may give it.
const MOST_READY_SECONDS: u32 = 3600;
/// How often the ready check runs, and how long one run may take.
const READY_EVERY: Duration = Duration::from_millis(500);
const READY_RUN: Duration = Duration::from_secs(30);
/// The largest `COPY` archive.
pub const MAX_TEMPLATE_FILES_BYTES: usize = 64 * 1024 * 1024;
/// Where a `COPY`'s archive is written in the build's guest.
const COPY_ARCHIVE: &str = "/tmp/.sandpit-template-copy.tar";

/// `name[:tag]` checked: lower-case letters, digits, `-`, `_`, `.`; 1 to
/// 63 characters each; tag `latest` by default.
pub fn parse_reference(reference: &str) -> Result<(String, String)> {
    let (name, tag) = match reference.split_once(':') {
        Some((n, t)) => (n, t),
        None => (reference, "latest"),
    };
    let ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.as_bytes()[0].is_ascii_alphanumeric()
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b))
    };
    if !ok(name) || !ok(tag) {
        return Err(CoreError::invalid(format!(
            "template {reference:?}: a name (and :tag) is 1 to 63 lower-case letters, digits, \
             '-', '_' or '.', starting with a letter or digit"
        )));
    }
    Ok((name.to_string(), tag.to_string()))
}

fn to_template(t: &TemplateRow, with_log: bool) -> Template {
    Template {
        id: t.id.clone(),
        object: "template".into(),
        name: t.name.clone(),
        tag: t.tag.clone(),
        size: t.size.clone(),
        status: t.status.as_str().into(),
        public: t.public,
        steps: t.steps,
        cached_steps: t.cached_steps,
        error: t.error.clone(),
        size_bytes: t.bytes,
        created_at: rfc3339(t.created_at),
        finished_at: t.finished_at.map(rfc3339),
        log: with_log.then(|| t.log.clone()),
        spec: with_log
            .then(|| serde_json::from_str(&t.spec).ok())
            .flatten(),
    }
}

/// A step as its log line names it.
fn describe(step: &Step) -> String {
    let short = |s: &str| {
        let line = s.lines().next().unwrap_or_default();
        match line.char_indices().nth(120) {
            Some((at, _)) => format!("{}…", &line[..at]),
            None if s.lines().nth(1).is_some() => format!("{line}…"),
            None => line.to_string(),
        }
    };
    match step {
        Step::Run { command, user } => match user {
            Some(u) => format!("RUN (as {}) {}", u.name(), short(command)),
            None => format!("RUN {}", short(command)),
        },
        Step::Copy {
            files,
            src: Some(src),
            dest,
            ..
        } => format!(
            "COPY {src} {dest} (files {}…)",
            &files[..12.min(files.len())]
        ),
        Step::Copy { files, dest, .. } => format!("COPY {}… {dest}", &files[..12.min(files.len())]),
        Step::Env { vars } => format!("ENV {}", vars.keys().cloned().collect::<Vec<_>>().join(" ")),
        Step::Workdir { path } => format!("WORKDIR {path}"),
        Step::User { user } => format!("USER {}", user.name()),
    }
}

/// Whether a step changes the VM (and so leaves a layer).
fn changes_the_vm(step: &Step) -> bool {
    matches!(
        step,
        Step::Run { .. } | Step::Copy { .. } | Step::Workdir { .. }
    )
}

/// A build's log: kept here, written to its row now and then (which also
/// says the build is alive).
struct BuildLog {
    service: Arc<Service>,
    id: String,
    text: String,
    cached_steps: u32,
    written: Instant,
}

impl BuildLog {
    fn line(&mut self, line: impl AsRef<str>) {
        self.text.push_str(line.as_ref());
        self.text.push('\n');
        self.trim();
    }

    fn output(&mut self, bytes: &[u8]) {
        self.text.push_str(&String::from_utf8_lossy(bytes));
        self.trim();
    }

    fn trim(&mut self) {
        // Twice what is stored, so that a write keeps the store's whole share.
        let most = 2 * sandpit_store::MAX_LOG_BYTES;
        if self.text.len() > most {
            let mut from = self.text.len() - sandpit_store::MAX_LOG_BYTES;
            while !self.text.is_char_boundary(from) {
                from += 1;
            }
            self.text.drain(..from);
        }
    }

    /// Written to the row when it last was over a second ago (or now,
    /// `force`).
    async fn flush(&mut self, force: bool) {
        if !force && self.written.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.written = Instant::now();
        if let Err(e) = self
            .service
            .store
            .template_progress(&self.id, &self.text, self.cached_steps)
            .await
        {
            tracing::warn!(template = %self.id, "writing its build log: {e}");
        }
    }

    /// Where the log is now, for [`BuildLog::tail_since`].
    fn mark(&self) -> usize {
        self.text.len()
    }

    /// The last lines written since `mark` (a step's own output), for an
    /// error.
    fn tail_since(&self, mark: usize, lines: usize) -> String {
        let from = if mark <= self.text.len() && self.text.is_char_boundary(mark) {
            mark
        } else {
            0
        };
        let all: Vec<&str> = self.text[from..].lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// What a finished build left: its last save, where, and what its layers
/// take.
struct Built {
    save: String,
    host: String,
    bytes: u64,
}

/// Why a build failed: said in the build's `error`.
fn failed(message: impl Into<String>) -> CoreError {
    CoreError::new(ErrorType::Conflict, message)
}

impl Service {
    /// A build's sandbox's lifetime: [`BUILD_MINUTES`], or the longest the
    /// operator allows.
    fn build_minutes(&self) -> u32 {
        BUILD_MINUTES.min(self.config.max_timeout_minutes)
    }

    /// The newest ready build of `reference` the caller may start from (its
    /// own, or a published one), and what its steps leave (the sandboxes'
    /// environment and working directory).
    pub(super) async fn startable_template(
        &self,
        caller: &Caller,
        reference: &str,
    ) -> Result<(TemplateRow, State)> {
        let (name, tag) = parse_reference(reference)?;
        let Some(template) = self
            .store
            .template_named(&caller.account_id, &name, &tag, &[TemplateStatus::Ready])
            .await?
        else {
            return Err(CoreError::not_found("template", &format!("{name}:{tag}")));
        };
        let spec: Spec = serde_json::from_str(&template.spec)
            .map_err(|e| CoreError::internal(format!("template {}'s spec: {e}", template.id)))?;
        let state = spec.states().pop().unwrap_or_default();
        Ok((template, state))
    }

    /// What a build request asks for, checked: the spec, ready for a VM.
    async fn checked_spec(&self, caller: &Caller, req: &BuildTemplate) -> Result<Spec> {
        let mut spec = match (&req.dockerfile, &req.spec) {
            (Some(_), Some(_)) => {
                return Err(CoreError::invalid("give a dockerfile or a spec, not both"))
            }
            (None, None) => return Err(CoreError::invalid("give a dockerfile or a spec")),
            (Some(text), None) => {
                let parsed = dockerfile::parse(text, &req.build_args)
                    .map_err(|e| CoreError::invalid(format!("the Dockerfile: {e}")))?;
                if !parsed.copies.is_empty() {
                    return Err(CoreError::invalid(
                        "the Dockerfile copies files: send it with `sandpit template build`, \
                         which uploads them, or as a spec whose copy steps name uploaded files",
                    ));
                }
                parsed.spec
            }
            (None, Some(value)) => serde_json::from_value::<Spec>(value.clone())
                .map_err(|e| CoreError::invalid(format!("the spec: {e}")))?,
        };
        if let Some(ready) = &req.ready_cmd {
            match &mut spec.start {
                Some(start) => start.ready = Some(ready.clone()),
                None => {
                    return Err(CoreError::invalid(
                        "a ready check without a start command: there is nothing to check",
                    ))
                }
            }
        }
        if req.no_cache {
            spec.force_from = Some(0);
        }
        self.check_spec(caller, &spec).await?;
        Ok(spec)
    }

    /// What can be checked of a spec before a VM starts: its steps, and
    /// that the account holds every copy's files.
    async fn check_spec(&self, caller: &Caller, spec: &Spec) -> Result<()> {
        spec.check().map_err(|e| CoreError::invalid(e.0))?;
        for step in &spec.steps {
            if let Step::Copy { files, .. } = step {
                if !self
                    .store
                    .has_template_files(&caller.account_id, files)
                    .await?
                {
                    return Err(CoreError::invalid(format!(
                        "the files {files} of a copy step were not uploaded \
                         (PUT /v1/templates/files/{files})"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Refuses a build of `name:tag` that would take the account past its
    /// templates' quota (count or bytes; checked before the build, so two
    /// racing builds may pass it by one).
    async fn check_quota(&self, caller: &Caller, (name, tag): (&str, &str)) -> Result<()> {
        let (held, bytes) = self
            .store
            .template_usage(&caller.account_id, (name, tag))
            .await?;
        let (max_count, max_bytes) = (
            u64::from(self.config.max_templates_per_account),
            self.config.template_bytes_per_account,
        );
        if held >= max_count || bytes >= max_bytes {
            return Err(CoreError::new(
                ErrorType::RateLimited,
                format!(
                    "the account holds {held} other templates taking {bytes} bytes; its quota \
                     is {max_count} templates and {max_bytes} bytes: delete templates (and \
                     their older builds) first"
                ),
            )
            .lasting());
        }
        Ok(())
    }

    /// The ready check's bound a build asks for, checked.
    fn ready_timeout(seconds: Option<u32>) -> Result<Duration> {
        match seconds {
            None => Ok(READY_TIMEOUT),
            Some(s) if (1..=MOST_READY_SECONDS).contains(&s) => {
                Ok(Duration::from_secs(u64::from(s)))
            }
            Some(s) => Err(CoreError::invalid(format!(
                "ready_timeout_seconds is 1..{MOST_READY_SECONDS}, not {s}"
            ))),
        }
    }

    /// A size a build may have (a build is a sandbox of it, for as long as
    /// a build may take); the service's default if none.
    fn build_size(&self, size: Option<String>) -> Result<String> {
        let size = size.unwrap_or_else(|| self.config.default_size.clone());
        crate::service::checks::check_create(
            &self.config,
            &CreateSandbox {
                size: Some(size.clone()),
                timeout_minutes: Some(self.build_minutes()),
                ..CreateSandbox::default()
            },
            None,
        )?;
        Ok(size)
    }

    /// The build's task: runs it, records how it ended, retires old
    /// builds, and ends its sandbox.
    async fn run_build(
        self: Arc<Self>,
        caller: Caller,
        row: TemplateRow,
        spec: Spec,
        ready: Duration,
    ) {
        let mut log = BuildLog {
            service: self.clone(),
            id: row.id.clone(),
            text: String::new(),
            cached_steps: 0,
            written: Instant::now(),
        };
        let mut sandbox = None;
        let started = Instant::now();
        let outcome = self
            .build(&caller, &row, &spec, ready, &mut log, &mut sandbox)
            .await;
        let finished = match outcome {
            Ok(built) => {
                log.line(format!(
                    "template {}:{} ready in {:.1} s ({} of {} steps cached)",
                    row.name,
                    row.tag,
                    started.elapsed().as_secs_f64(),
                    log.cached_steps,
                    row.steps
                ));
                self.store
                    .template_progress(&row.id, &log.text, log.cached_steps)
                    .await
                    .ok();
                self.store
                    .finish_template(
                        &row.id,
                        Ok((&built.save, &built.host, built.bytes)),
                        &log.text,
                    )
                    .await
            }
            Err(e) => {
                // Its first line: the rest (the step's last lines) is above.
                log.line(format!(
                    "build failed: {}",
                    e.message.lines().next().unwrap_or_default()
                ));
                self.store
                    .template_progress(&row.id, &log.text, log.cached_steps)
                    .await
                    .ok();
                self.store
                    .finish_template(&row.id, Err(&e.message), &log.text)
                    .await
            }
        };
        if let Err(e) = finished {
            tracing::warn!(template = %row.id, "recording the build's end: {e}");
        }
        // Once the build is told: its sandbox is not needed for it.
        if let Some(id) = &sandbox {
            if let Err(e) = self.destroy_sandbox(&caller, id).await {
                tracing::warn!(template = %row.id, sandbox = %id, "ending the build's sandbox: {}", e.message);
            }
        }
        match self
            .store
            .retire_templates(&row.account_id, &row.name, &row.tag, KEEP_BUILDS)
            .await
        {
            Ok(retired) => {
                for t in retired {
                    tracing::info!(template = %t.id, "retired: {KEEP_BUILDS} newer builds of {}:{}", t.name, t.tag);
                }
            }
            Err(e) => tracing::warn!(template = %row.id, "retiring older builds: {e}"),
        }
    }

    /// Runs the build's steps from the last cached layer; `sandbox` names
    /// the build's sandbox once it has one (for the caller to end).
    async fn build(
        &self,
        caller: &Caller,
        row: &TemplateRow,
        spec: &Spec,
        ready: Duration,
        log: &mut BuildLog,
        sandbox: &mut Option<String>,
    ) -> Result<Built> {
        let keys = spec.layer_keys(&format!("sandpit:{}", row.size));
        let states = spec.states();
        let steps = spec.steps.len();
        let force_from = spec.force_from.unwrap_or(usize::MAX);
        let hosts: Vec<String> = self
            .placement(&row.size)
            .await?
            .into_iter()
            .map(|p| p.host)
            .collect();
        // The last layer found: after `done` steps (`steps + 1`: the whole
        // template, start command and all).
        let mut resume: Option<(usize, LayerRow)> = None;
        for (i, key) in keys.iter().enumerate().rev() {
            if i >= force_from || (i < steps && !changes_the_vm(&spec.steps[i])) {
                continue;
            }
            if let Some(layer) = self
                .store
                .template_layer(&caller.account_id, key, &hosts)
                .await?
            {
                resume = Some((i + 1, layer));
                break;
            }
        }
        // Without a start command, the template is the layer of its last
        // step that changed the VM (the steps after it change nothing
        // there): no save of its own.
        let last_change = spec.steps.iter().rposition(changes_the_vm);
        let last_layer_is_all =
            |done: usize| spec.start.is_none() && last_change.is_some_and(|j| done == j + 1);
        let mut done = resume.as_ref().map_or(0, |(done, _)| *done);
        if last_layer_is_all(done) {
            done = steps + 1;
        }
        for (i, step) in spec.steps.iter().enumerate().take(done.min(steps)) {
            log.line(format!(
                "step {}/{steps}: {} (cached)",
                i + 1,
                describe(step)
            ));
        }
        log.cached_steps = done.min(steps) as u32;
        if let Some((_, layer)) = &resume {
            if done == steps + 1 {
                log.line("the whole template is cached");
                return Ok(Built {
                    save: layer.save_id.clone(),
                    host: layer.host.clone(),
                    bytes: layer.bytes,
                });
            }
        }
        log.flush(true).await;
        let (made, _) = self
            .create(
                caller,
                CreateSandbox {
                    size: Some(row.size.clone()),
                    name: Some(format!("template build {}:{}", row.name, row.tag)),
                    timeout_minutes: Some(self.build_minutes()),
                    layer: resume.as_ref().map(|(_, l)| LayerStart {
                        save_id: l.save_id.clone(),
                        host: l.host.clone(),
                    }),
                    ..CreateSandbox::default()
                },
                None,
            )
            .await?;
        *sandbox = Some(made.id.clone());
        let vm = self
            .store
            .sandbox(&made.id)
            .await?
            .ok_or_else(|| CoreError::internal("the build's sandbox vanished"))?;
        let machines = self.machines_for(&vm).await?;
        let deadline = Instant::now() + Duration::from_secs(u64::from(self.build_minutes()) * 60);
        let mut bytes = resume.as_ref().map_or(0, |(_, l)| l.bytes);
        // The newest layer's save, and what it takes.
        let mut last_layer = resume.as_ref().map(|(_, l)| (l.save_id.clone(), l.bytes));
        for i in done..steps {
            let step = &spec.steps[i];
            let state = &states[i];
            log.line(format!("step {}/{steps}: {}", i + 1, describe(step)));
            log.flush(true).await;
            let t = Instant::now();
            self.run_step(caller, &vm, &machines, step, state, deadline, log)
                .await
                .map_err(|e| {
                    failed(format!(
                        "step {} ({}): {}",
                        i + 1,
                        describe(step),
                        e.message
                    ))
                })?;
            if changes_the_vm(step) {
                let ran = t.elapsed();
                let t = Instant::now();
                let saved = self.save_layer(caller, &vm, &machines, &keys[i]).await?;
                log.line(format!(
                    "step {}/{steps} done in {:.1} s, its layer saved in {} ms",
                    i + 1,
                    ran.as_secs_f64(),
                    t.elapsed().as_millis()
                ));
                bytes += saved.1;
                last_layer = Some(saved);
            }
        }
        if spec.start.is_none() && last_change.is_some() {
            if let Some((save, _)) = last_layer {
                return Ok(Built {
                    save,
                    host: vm.host.clone(),
                    bytes,
                });
            }
        }
        let last = states.last().cloned().unwrap_or_default();
        let follower = match &spec.start {
            Some(start) => Some(
                self.start_and_wait(&vm, &machines, start, &last, ready, log)
                    .await?,
            ),
            None => None,
        };
        let (save, final_bytes) = self
            .save_layer(caller, &vm, &machines, &keys[steps])
            .await?;
        drop(follower);
        Ok(Built {
            save,
            host: vm.host.clone(),
            bytes: bytes + final_bytes,
        })
    }

    /// Saves the build's VM as the layer of `key` (its row first, so that a
    /// sweep never takes the new save for an orphan); returns the save and
    /// what it takes.
    async fn save_layer(
        &self,
        caller: &Caller,
        vm: &SandboxRow,
        machines: &Arc<dyn Machines>,
        key: &str,
    ) -> Result<(String, u64)> {
        let mut layer = LayerRow {
            account_id: caller.account_id.clone(),
            layer_key: key.to_string(),
            host: vm.host.clone(),
            save_id: sandpit_host::ids::new_id("snap_"),
            size: vm.size.clone(),
            bytes: 0,
        };
        self.store.put_template_layer(&layer).await?;
        match machines.snapshot(&vm.id, &layer.save_id).await {
            Ok(bytes) => {
                layer.bytes = bytes;
                self.store.put_template_layer(&layer).await?;
                Ok((layer.save_id, bytes))
            }
            Err(e) => {
                let _ = machines.delete_snapshot(&layer.save_id).await;
                Err(failed(format!("saving the build's layer: {e}")))
            }
        }
    }

    /// Runs one step in the build's VM.
    #[allow(clippy::too_many_arguments)]
    async fn run_step(
        &self,
        caller: &Caller,
        vm: &SandboxRow,
        machines: &Arc<dyn Machines>,
        step: &Step,
        state: &State,
        deadline: Instant,
        log: &mut BuildLog,
    ) -> Result<()> {
        let (script, user) = match step {
            Step::Run { command, user } => (command.clone(), user.unwrap_or(state.user)),
            Step::Copy {
                files,
                src,
                dest,
                user,
                mode,
            } => {
                let tar = self
                    .store
                    .template_files(&caller.account_id, files)
                    .await?
                    .ok_or_else(|| failed(format!("the files {files} were not uploaded")))?;
                machines
                    .write_file(&vm.id, COPY_ARCHIVE, tar)
                    .await
                    .map_err(|e| failed(format!("writing the files into the build: {e}")))?;
                let owner = user.unwrap_or(state.user);
                let script = match src {
                    None => copy_script(dest, owner, *mode),
                    Some(src) => context_copy_script(COPY_ARCHIVE, src, dest, owner, *mode),
                };
                (script, User::Root)
            }
            Step::Workdir { path } => (workdir_script(path, state.user), User::Root),
            Step::Env { .. } | Step::User { .. } => return Ok(()),
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(failed(format!(
                "the build ran out of its {BUILD_MINUTES} minutes"
            )));
        }
        let request = ExecRequest {
            command: script,
            cwd: Some(state.workdir.clone()),
            env: state.env.clone(),
            timeout_ms: left.as_millis() as u64,
            max_output_bytes: u64::MAX,
            as_root: user == User::Root,
            ..ExecRequest::default()
        };
        let mark = log.mark();
        let mut command = machines
            .exec(&vm.id, request)
            .await
            .map_err(|e| failed(format!("starting it: {e}")))?;
        loop {
            match tokio::time::timeout(HEARTBEAT, command.next()).await {
                Err(_) => log.flush(true).await,
                Ok(Ok(GuestExecEvent::Stdout(b) | GuestExecEvent::Stderr(b))) => {
                    log.output(&b);
                    log.flush(false).await;
                }
                Ok(Ok(GuestExecEvent::Started(_))) => {}
                Ok(Ok(GuestExecEvent::Exited(result))) => {
                    return match (result.exit_code, result.timed_out) {
                        (Some(0), _) => Ok(()),
                        (_, true) => Err(failed(format!(
                            "it ran out of the build's {BUILD_MINUTES} minutes"
                        ))),
                        (Some(code), _) => Err(failed(format!(
                            "it exited with code {code}; its last lines:\n{}",
                            log.tail_since(mark, 15)
                        ))),
                        (None, _) => Err(failed(format!(
                            "it was killed by signal {}",
                            result.signal.unwrap_or_default()
                        ))),
                    };
                }
                Ok(Err(e)) => return Err(failed(format!("the build's VM: {e}"))),
            }
        }
    }

    /// Starts the start command (as the build's last user, where its steps
    /// left off) and waits for its ready check to pass: the command is
    /// then running in the VM that is saved. Returns the command's
    /// follower, dropped once the save is taken (the command goes on).
    async fn start_and_wait(
        &self,
        vm: &SandboxRow,
        machines: &Arc<dyn Machines>,
        start: &Start,
        state: &State,
        ready: Duration,
        log: &mut BuildLog,
    ) -> Result<Box<dyn Command>> {
        log.line(format!("start: {}", start.command));
        log.flush(true).await;
        let request = |command: &str, keep_running: bool, timeout: Duration| ExecRequest {
            command: command.to_string(),
            cwd: Some(state.workdir.clone()),
            env: state.env.clone(),
            timeout_ms: timeout.as_millis() as u64,
            max_output_bytes: if keep_running { u64::MAX } else { 64 * 1024 },
            keep_running,
            as_root: state.user == User::Root,
            ..ExecRequest::default()
        };
        let mut command = machines
            .exec(&vm.id, request(&start.command, true, Duration::ZERO))
            .await
            .map_err(|e| failed(format!("starting the start command: {e}")))?;
        let mark = log.mark();
        let began = Instant::now();
        let wait = match &start.ready {
            Some(_) => ready,
            None => Duration::from_secs(Start::SETTLE_SECS),
        };
        let mut checked = Instant::now();
        loop {
            // Its output meanwhile, and whether it ended.
            match tokio::time::timeout(READY_EVERY, command.next()).await {
                Err(_) | Ok(Ok(GuestExecEvent::Started(_))) => {}
                Ok(Ok(GuestExecEvent::Stdout(b) | GuestExecEvent::Stderr(b))) => log.output(&b),
                Ok(Ok(GuestExecEvent::Exited(result))) => {
                    return Err(failed(format!(
                        "the start command ended ({}) before it was ready; its last lines:\n{}",
                        match result.exit_code {
                            Some(code) => format!("exit code {code}"),
                            None => format!("signal {}", result.signal.unwrap_or_default()),
                        },
                        log.tail_since(mark, 15)
                    )))
                }
                Ok(Err(e)) => return Err(failed(format!("the build's VM: {e}"))),
            }
            log.flush(false).await;
            let Some(check) = &start.ready else {
                if began.elapsed() >= wait {
                    log.line("the start command runs (no ready check)");
                    return Ok(command);
                }
                continue;
            };
            if checked.elapsed() >= READY_EVERY {
                checked = Instant::now();
                let run = machines
                    .exec(&vm.id, request(check, false, READY_RUN))
                    .await
                    .map_err(|e| failed(format!("running the ready check: {e}")))?;
                if exit_code(run).await == Some(0) {
                    log.line(format!(
                        "ready after {:.1} s: {check}",
                        began.elapsed().as_secs_f64()
                    ));
                    return Ok(command);
                }
            }
            if began.elapsed() >= wait {
                return Err(failed(format!(
                    "the ready check ({check}) did not pass within {} s; the start command's \
                     last lines:\n{}",
                    wait.as_secs(),
                    log.tail_since(mark, 15)
                )));
            }
        }
    }
}

/// How a command ended (its output dropped).
async fn exit_code(mut command: Box<dyn Command>) -> Option<i32> {
    loop {
        match command.next().await {
            Ok(GuestExecEvent::Exited(result)) => return result.exit_code,
            Ok(_) => {}
            Err(_) => return None,
        }
    }
}

/// Unpacks a `COPY`'s archive into `dest` as root, its entries then owned
/// by `owner` (and given `mode`), and removes the archive.
fn copy_script(dest: &str, owner: User, mode: Option<u32>) -> String {
    let dest = shell_words::quote(dest);
    let mut s = format!(
        "set -e; a={COPY_ARCHIVE}; mkdir -p -- {dest}; \
         tar -xf \"$a\" -C {dest} --no-same-owner; \
         entries() {{ tar -tf \"$a\" | sed -e 's#^\\./##' -e 's#/$##' | grep -v '^\\.\\?$' | sort -u; }}; "
    );
    if owner == User::User {
        s.push_str(&format!(
            "entries | (cd {dest} && xargs -r -d '\\n' chown -h user:user --); "
        ));
    }
    if let Some(mode) = mode {
        s.push_str(&format!(
            "entries | (cd {dest} && xargs -r -d '\\n' chmod {mode:o} --); "
        ));
    }
    s.push_str("rm -f -- \"$a\"");
    s
}

/// Copies what `src` (a path or a glob) matches in an uploaded build
/// context (E2B's: paths relative to the context, maybe gzipped, which
/// `tar` tells by itself) as Docker's `COPY` does: a directory's contents
/// into `dest`; a file into `dest` when it ends with `/`, is a directory
/// or several sources match, else to `dest` itself. Run as root; what it
/// copies (and `dest`, when it made it) then goes to `owner`, with `mode`
/// when given. A `src` that matches nothing fails the step, naming it.
fn context_copy_script(
    archive: &str,
    src: &str,
    dest: &str,
    owner: User,
    mode: Option<u32>,
) -> String {
    let mut fix = String::new();
    if owner == User::User {
        fix.push_str("xargs -0 -r chown -h user:user -- < \"$1\"; ");
    }
    if let Some(mode) = mode {
        fix.push_str(&format!("xargs -0 -r chmod {mode:o} -- < \"$1\"; "));
    }
    if fix.is_empty() {
        fix.push_str(": ; ");
    }
    let own_dest = if owner == User::User {
        "if [ -n \"$made\" ]; then chown user:user -- \"$dest\"; fi; "
    } else {
        ""
    };
    format!(
        "set -e; a={archive}; c=$(mktemp -d); l=$(mktemp); \
         trap 'rm -rf -- \"$c\" \"$l\" \"$a\"' EXIT; \
         src={src}; dest={dest}; \
         case \"$dest\" in /*) ;; *) dest=\"$PWD/$dest\" ;; esac; \
         fix() {{ {fix} }}; \
         tar -xf \"$a\" -C \"$c\" --no-same-owner; cd \"$c\"; \
         shopt -s nullglob dotglob; IFS=; m=( $src ); IFS=' '; found=(); \
         for x in \"${{m[@]}}\"; do if [ -e \"$x\" ] || [ -L \"$x\" ]; then found+=(\"${{x%/}}\"); fi; done; \
         if [ ${{#found[@]}} -eq 0 ]; then \
           echo \"COPY: $src matches nothing in the uploaded files\" >&2; exit 1; fi; \
         into=; case \"$dest\" in */) into=1 ;; esac; \
         if [ ${{#found[@]}} -gt 1 ] || [ -d \"$dest\" ]; then into=1; fi; \
         made=; if [ ! -e \"$dest\" ]; then made=1; fi; dest=${{dest%/}}; dest=${{dest:-/}}; \
         for x in \"${{found[@]}}\"; do \
           if [ -d \"$x\" ] && [ ! -L \"$x\" ]; then \
             mkdir -p -- \"$dest\"; cp -a -- \"$x/.\" \"$dest/\"; \
             (cd \"$x\" && find . -mindepth 1 -printf '%P\\0') > \"$l\"; (cd \"$dest\" && fix \"$l\"); \
           else \
             if [ -n \"$into\" ]; then mkdir -p -- \"$dest\"; t=\"$dest/${{x##*/}}\"; \
             else mkdir -p -- \"$(dirname -- \"$dest\")\"; t=$dest; fi; \
             cp -a -- \"$x\" \"$t\"; printf '%s\\0' \"$t\" > \"$l\"; fix \"$l\"; \
           fi; \
         done; {own_dest}",
        archive = shell_words::quote(archive),
        src = shell_words::quote(src),
        dest = shell_words::quote(dest),
    )
}

/// Makes a `WORKDIR` (as root; the user's when the build runs as the user
/// and it is new).
fn workdir_script(path: &str, user: User) -> String {
    let path = shell_words::quote(path);
    match user {
        User::Root => format!("mkdir -p -- {path}"),
        User::User => {
            format!("[ -d {path} ] || {{ mkdir -p -- {path} && chown user:user {path}; }}")
        }
    }
}

#[async_trait::async_trait]
impl Templates for Service {
    async fn build_template(&self, caller: &Caller, req: BuildTemplate) -> Result<Template> {
        let (name, tag) = parse_reference(&req.name)?;
        let size = self.build_size(req.size.clone())?;
        let ready = Self::ready_timeout(req.ready_timeout_seconds)?;
        self.check_quota(caller, (&name, &tag)).await?;
        let spec = self.checked_spec(caller, &req).await?;
        let me = self
            .arc_self()
            .ok_or_else(|| CoreError::internal("the service is shutting down"))?;
        let row = self
            .store
            .create_template(
                &sandpit_host::ids::new_id("tpl_"),
                &caller.account_id,
                (&name, &tag),
                &size,
                &serde_json::to_string(&spec).expect("a spec serializes"),
                spec.steps.len() as u32,
            )
            .await?;
        tokio::spawn(me.run_build(caller.clone(), row.clone(), spec, ready));
        Ok(to_template(&row, false))
    }

    async fn get_template(&self, caller: &Caller, id: &str) -> Result<Template> {
        let row = if id.starts_with("tpl_") {
            self.store
                .template(id)
                .await?
                .filter(|t| t.account_id == caller.account_id || t.public)
                .filter(|t| t.status != TemplateStatus::Deleted)
        } else {
            // By name: the build sandboxes start from (the newest ready
            // one), else the newest at all (a first build, going or failed).
            let (name, tag) = parse_reference(id)?;
            let account = &caller.account_id;
            match self
                .store
                .template_named(account, &name, &tag, &[TemplateStatus::Ready])
                .await?
            {
                Some(ready) => Some(ready),
                None => {
                    self.store
                        .template_named(
                            account,
                            &name,
                            &tag,
                            &[TemplateStatus::Building, TemplateStatus::Failed],
                        )
                        .await?
                }
            }
        };
        let row = row.ok_or_else(|| CoreError::not_found("template", id))?;
        Ok(to_template(&row, true))
    }

    async fn list_templates(&self, caller: &Caller) -> Result<List<Template>> {
        let rows = self.store.templates_of(&caller.account_id).await?;
        Ok(List::new(
            rows.iter().map(|t| to_template(t, false)).collect(),
            false,
            None,
        ))
    }

    async fn delete_template(&self, caller: &Caller, id: &str) -> Result<Template> {
        let row = self
            .store
            .template(id)
            .await?
            .filter(|t| t.account_id == caller.account_id && t.status != TemplateStatus::Deleted)
            .ok_or_else(|| CoreError::not_found("template", id))?;
        if row.status == TemplateStatus::Building {
            return Err(CoreError::conflict(format!(
                "template {id} is still building; delete it once it is done"
            )));
        }
        let deleted = self
            .store
            .delete_template(id)
            .await?
            .ok_or_else(|| CoreError::not_found("template", id))?;
        Ok(to_template(&deleted, false))
    }

    async fn upload_template_files(
        &self,
        caller: &Caller,
        sha256: &str,
        tar: Vec<u8>,
    ) -> Result<()> {
        if tar.len() > MAX_TEMPLATE_FILES_BYTES {
            return Err(CoreError::invalid(format!(
                "a copy step's files are at most {MAX_TEMPLATE_FILES_BYTES} bytes"
            )));
        }
        let actual = hex::encode(sha2::Sha256::digest(&tar));
        if actual != sha256.to_ascii_lowercase() {
            return Err(CoreError::invalid(format!(
                "the files' SHA-256 is {actual}, not {sha256}"
            )));
        }
        self.store
            .put_template_files(&caller.account_id, &actual, &tar)
            .await?;
        Ok(())
    }

    async fn has_template_files(&self, caller: &Caller, key: &str) -> Result<bool> {
        Ok(self
            .store
            .has_template_files(&caller.account_id, &key.to_ascii_lowercase())
            .await?)
    }

    async fn reserve_template_build(
        &self,
        caller: &Caller,
        name: &str,
        size: Option<String>,
    ) -> Result<ReservedBuild> {
        let (name, tag) = parse_reference(name)?;
        let size = self.build_size(size)?;
        self.check_quota(caller, (&name, &tag)).await?;
        let token = hex::encode(rand::random::<[u8; 24]>());
        let row = self
            .store
            .reserve_template(
                &sandpit_host::ids::new_id("tpl_"),
                &caller.account_id,
                (&name, &tag),
                &size,
                &token,
            )
            .await?;
        Ok(ReservedBuild {
            template: to_template(&row, false),
            upload_token: token,
        })
    }

    async fn template_upload_token(&self, caller: &Caller, id: &str) -> Result<String> {
        self.store
            .template(id)
            .await?
            .filter(|t| t.account_id == caller.account_id && t.status == TemplateStatus::Waiting)
            .and_then(|t| t.upload_token)
            .ok_or_else(|| CoreError::not_found("waiting template build", id))
    }

    async fn start_template_build(
        &self,
        caller: &Caller,
        id: &str,
        spec: std::result::Result<Spec, sandpit_templates::SpecError>,
    ) -> Result<Template> {
        let waiting = self
            .store
            .template(id)
            .await?
            .filter(|t| t.account_id == caller.account_id)
            .ok_or_else(|| CoreError::not_found("template build", id))?;
        if waiting.status != TemplateStatus::Waiting {
            return Err(CoreError::conflict(format!(
                "build {id} is {}: a build starts once",
                waiting.status.as_str()
            )));
        }
        let checked = match spec {
            Ok(spec) => self.check_spec(caller, &spec).await.map(|()| spec),
            Err(e) => Err(CoreError::invalid(e.0)),
        };
        let spec = match checked {
            Ok(spec) => spec,
            Err(e) => {
                // Refused: the build fails now, not when the reaper finds
                // it waiting, and says why.
                if self.store.start_template(id, "{}", 0).await?.is_some() {
                    let log = format!("build refused: {}\n", e.message);
                    self.store
                        .finish_template(id, Err(&e.message), &log)
                        .await?;
                }
                return Err(e);
            }
        };
        let me = self
            .arc_self()
            .ok_or_else(|| CoreError::internal("the service is shutting down"))?;
        let row = self
            .store
            .start_template(
                id,
                &serde_json::to_string(&spec).expect("a spec serializes"),
                spec.steps.len() as u32,
            )
            .await?
            .ok_or_else(|| CoreError::conflict(format!("build {id} has started already")))?;
        tokio::spawn(me.run_build(caller.clone(), row.clone(), spec, READY_TIMEOUT));
        Ok(to_template(&row, false))
    }

    async fn upload_template_context(
        &self,
        build_id: &str,
        upload_token: &str,
        key: &str,
        archive: Vec<u8>,
    ) -> Result<()> {
        let refused = || {
            CoreError::new(
                ErrorType::Unauthorized,
                "this upload link is not (or no longer) valid: ask for the build again",
            )
        };
        let build = self.store.template(build_id).await?.ok_or_else(refused)?;
        let token_ok = build.status == TemplateStatus::Waiting
            && build.upload_token.as_deref().is_some_and(|t| {
                sandpit_host::ids::constant_time_eq(t.as_bytes(), upload_token.as_bytes())
            });
        if !token_ok {
            return Err(refused());
        }
        let key = key.to_ascii_lowercase();
        if key.len() != 64 || !key.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(CoreError::invalid(format!(
                "{key:?} is not a files hash (64 hex digits)"
            )));
        }
        if archive.len() > MAX_TEMPLATE_FILES_BYTES {
            return Err(CoreError::invalid(format!(
                "a copy step's files are at most {MAX_TEMPLATE_FILES_BYTES} bytes"
            )));
        }
        self.store
            .put_template_files(&build.account_id, &key, &archive)
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reference_is_a_name_and_a_tag() {
        assert_eq!(
            parse_reference("web").unwrap(),
            ("web".to_string(), "latest".to_string())
        );
        assert_eq!(
            parse_reference("code-interpreter:v1.2").unwrap(),
            ("code-interpreter".to_string(), "v1.2".to_string())
        );
        for bad in ["", "Web", "a:b:c", "-x", "web:", "a/b", &"x".repeat(64)] {
            assert!(parse_reference(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_copy_unpacks_as_root_and_hands_its_entries_over() {
        let s = copy_script("/srv/my site", User::User, Some(0o644));
        assert!(s.contains("mkdir -p -- '/srv/my site'"), "{s}");
        assert!(s.contains("--no-same-owner"), "{s}");
        assert!(s.contains("chown -h user:user"), "{s}");
        assert!(s.contains("chmod 644"), "{s}");
        let root = copy_script("/app", User::Root, None);
        assert!(!root.contains("chown") && !root.contains("chmod"), "{root}");
    }

    /// The script run by a real shell on a real (gzipped) context, as
    /// E2B's SDKs pack one: each of Docker's cases lands where `COPY`
    /// puts it, with its mode; a source that matches nothing says so.
    #[test]
    fn a_context_copy_lays_files_out_as_dockers_copy() {
        use std::path::Path;
        use std::process::Command;
        let dir = tempfile::tempdir().unwrap();
        let ctx = dir.path().join("ctx");
        let write = |p: &str, body: &str| {
            let p = ctx.join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, body).unwrap();
        };
        write("site/index.html", "<h1>hi</h1>");
        write("site/css/a.css", "h1{}");
        write("app.py", "print(1)");
        write("tool.py", "print(2)");
        let archive = dir.path().join("ctx.tar.gz");
        let packed = Command::new("tar")
            .arg("-czf")
            .arg(&archive)
            .arg("-C")
            .arg(&ctx)
            .args(["site", "app.py", "tool.py"])
            .status()
            .unwrap();
        assert!(packed.success());
        let out = dir.path().join("out");
        let copy = |src: &str, dest: &str, mode: Option<u32>| {
            // The script removes its archive, as in a build: a copy each run.
            let a = dir.path().join("a.tgz");
            std::fs::copy(&archive, &a).unwrap();
            let script = context_copy_script(a.to_str().unwrap(), src, dest, User::Root, mode);
            let run = Command::new("bash")
                .args(["-c", &script])
                .current_dir(dir.path())
                .output()
                .unwrap();
            assert!(
                !a.exists(),
                "the archive is removed: {}",
                String::from_utf8_lossy(&run.stderr)
            );
            run
        };
        let ok = |r: std::process::Output| {
            assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        };
        let o = out.to_str().unwrap();
        ok(copy("site/", &format!("{o}/www/"), None));
        assert_eq!(
            std::fs::read_to_string(out.join("www/index.html")).unwrap(),
            "<h1>hi</h1>"
        );
        assert!(
            out.join("www/css/a.css").is_file(),
            "a directory's contents, kept whole"
        );
        ok(copy("app.py", &format!("{o}/bin/run.py"), Some(0o600)));
        let renamed = out.join("bin/run.py");
        assert_eq!(std::fs::read_to_string(&renamed).unwrap(), "print(1)");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            renamed.metadata().unwrap().permissions().mode() & 0o777,
            0o600
        );
        ok(copy("*.py", &format!("{o}/py"), None));
        assert!(
            out.join("py/app.py").is_file() && out.join("py/tool.py").is_file(),
            "several sources go into dest"
        );
        // Relative to the step's directory.
        ok(copy("app.py", "rel/", None));
        assert!(dir.path().join("rel/app.py").is_file());
        let missing = copy("nope/*.txt", &format!("{o}/x/"), None);
        assert!(!missing.status.success());
        assert!(String::from_utf8_lossy(&missing.stderr).contains("nope/*.txt matches nothing"));
        assert!(!Path::new(&format!("{o}/x")).exists());
    }
}
