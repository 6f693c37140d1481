//! The size templates as the VM manager keeps them (see
//! [`crate::save::template`] for what a template is): found by the inputs
//! that made it, built once per size (a cold boot, warmed up, saved),
//! discarded when a restore from it fails.

use super::*;

/// Snapshot templates (see `template`): find, build, discard.
impl VmManager {
    /// Templates are on, and this QEMU can restore them.
    pub fn snapshots_supported(&self) -> bool {
        self.config.snapshots && self.qemu_version.restores_templates()
    }

    /// Where templates live.
    pub fn templates_dir(&self) -> PathBuf {
        self.config.data_dir.join("templates")
    }

    pub(crate) fn template_inputs(&self, size_name: &str, size: SizeSpec) -> TemplateInputs {
        TemplateInputs {
            format: template::FORMAT,
            image_id: self.image.id.clone(),
            size: size_name.to_string(),
            resources: size,
            qemu_version: self.qemu_version.line.clone(),
            accel: self.accel,
            tcg_tb_size_mb: self.config.tcg_tb_size_mb,
            kernel_cmdline: kernel_cmdline(self.accel, 0),
            machine: machine_type(self.accel),
            // The operator's deny list, not the host's addresses that every
            // VM's list also holds: those change when the host gains an
            // address (a bridge, a VPN, a test's namespace), and a restore
            // sends the whole plan again, which the agent applies when it
            // differs from the template's. So a new address costs restores
            // a ruleset load, not every template a rebuild, and two managers
            // made a moment apart agree on the key.
            network: self.config.network.enabled.then(|| {
                let configured = NetworkConfig {
                    deny: self.config.network.deny.clone(),
                    ..self.network_config(&Egress::open())
                };
                serde_json::to_value(configured).expect("json")
            }),
            user_pids_max: self.config.user_pids_max,
            reserved_memory_mb: self.config.reserved_memory_mb,
            ca_certificates: template::ca_digest(&self.ca_certificates),
            volume_slots: super::volumes::VOLUME_SLOTS,
        }
    }

    /// The directory names of the current templates of the configured
    /// sizes, built or not.
    pub(crate) fn current_template_dirs(&self) -> std::collections::HashSet<String> {
        self.config
            .sizes
            .iter()
            .map(|(name, size)| template::dir_name(name, &self.template_inputs(name, *size).key()))
            .collect()
    }

    /// The finished template of `size` for this image, QEMU and config, if
    /// one has been built.
    pub fn template(&self, size_name: &str) -> Option<Template> {
        if !self.snapshots_supported() {
            return None;
        }
        let size = self.config.size(size_name).ok()?;
        let inputs = self.template_inputs(size_name, size);
        let dir = self
            .templates_dir()
            .join(template::dir_name(size_name, &inputs.key()));
        template::load(&dir, &inputs, crate::host::accel::host_tsc_khz())
    }

    /// The template of `size`, built first when there is none (about a cold
    /// boot plus three seconds). Concurrent callers, in this process or
    /// another on the same data directory, build it once.
    pub async fn ensure_template(&self, size_name: &str) -> Result<Template> {
        if !self.snapshots_supported() {
            return Err(RuntimeError::Launch(format!(
                "snapshot templates need QEMU 8.2 or newer (this is {}) and snapshots enabled",
                self.qemu_version.line
            )));
        }
        if let Some(t) = self.template(size_name) {
            return Ok(t);
        }
        let size = self.config.size(size_name)?;
        validate_id(size_name)?;
        let dir = self.templates_dir();
        std::fs::create_dir_all(&dir)
            .map_err(RuntimeError::io(format!("creating {}", dir.display())))?;
        allow_traverse(&dir);
        let _lock = template::lock(&dir, size_name).await?;
        if let Some(t) = self.template(size_name) {
            return Ok(t);
        }
        let inputs = self.template_inputs(size_name, size);
        let name = template::dir_name(size_name, &inputs.key());
        // Outdated templates and the leftovers of builds that died.
        match self.templates_in_use_now() {
            Some(in_use) => template::remove_others(&dir, size_name, None, &in_use),
            None => tracing::warn!("a save's record is unreadable: no old template is removed"),
        }
        let tmp = dir.join(format!(".{name}.{}.tmp", rand::random::<u32>()));
        let started = Instant::now();
        tracing::info!(size = size_name, template = %name, "building a snapshot template");
        let mut built = self.build_template_in(&tmp, size_name, size).await;
        // A boot that hung (see `start_cold`): once more, in a clean directory.
        if let Err(e @ RuntimeError::BootTimeout { .. }) = built {
            tracing::warn!(
                size = size_name,
                "the template's boot did not come up; booting it again: {e}"
            );
            let _ = std::fs::remove_dir_all(&tmp);
            built = self.build_template_in(&tmp, size_name, size).await;
        }
        if let Err(e) = built {
            let _ = std::fs::remove_dir_all(&tmp);
            template::count_build(false);
            return Err(match e {
                e @ RuntimeError::BootTimeout { .. } => {
                    RuntimeError::Launch(format!("booting the template VM: {e}"))
                }
                e => e,
            });
        }
        let record = template::TemplateRecord {
            inputs,
            tsc_khz: crate::host::accel::host_tsc_khz(),
            created_at: OffsetDateTime::now_utc(),
            build_secs: started.elapsed().as_secs_f64(),
        };
        let finish = || -> std::io::Result<()> {
            use std::os::unix::fs::PermissionsExt;
            std::fs::write(
                tmp.join(template::RECORD),
                serde_json::to_vec_pretty(&record).expect("json"),
            )?;
            // Restored VMs' QEMUs (each its own uid) only read these; none
            // may write them.
            let stub = tmp.join(template::KERNEL_STUB);
            if let Err(e) = template::write_kernel_stub(&self.image.kernel, &stub) {
                // Not a bzImage: restores pass the whole kernel, as a boot does.
                tracing::info!("no kernel stub for restores ({e}); they use the kernel itself");
                std::fs::copy(&self.image.kernel, &stub)?;
            }
            for f in [
                template::MEM,
                template::STATE,
                template::DISK,
                template::KERNEL_STUB,
            ] {
                let f = tmp.join(f);
                std::os::unix::fs::chown(&f, Some(0), Some(0)).ok();
                std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644))?;
            }
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
            std::fs::rename(&tmp, dir.join(&name))
        };
        if let Err(e) = finish() {
            let _ = std::fs::remove_dir_all(&tmp);
            template::count_build(false);
            return Err(RuntimeError::io("finishing the template")(e));
        }
        template::count_build(true);
        tracing::info!(
            size = size_name,
            template = %name,
            "snapshot template ready in {:.1} s",
            record.build_secs
        );
        self.template(size_name).ok_or_else(|| {
            RuntimeError::Launch(format!(
                "the template {name} vanished right after its build"
            ))
        })
    }

    /// Remove a template that failed to restore, so the next
    /// `ensure_template` builds it again.
    pub fn discard_template(&self, template: &Template) {
        let gone = template.dir.with_file_name(format!(
            ".{}-{}.{}.tmp",
            template.size,
            template.key,
            rand::random::<u32>()
        ));
        if std::fs::rename(&template.dir, &gone).is_ok() {
            let _ = std::fs::remove_dir_all(&gone);
        }
    }

    async fn build_template_in(&self, dir: &Path, size_name: &str, size: SizeSpec) -> Result<()> {
        std::fs::create_dir(dir)
            .map_err(RuntimeError::io(format!("creating {}", dir.display())))?;
        let paths = VmPaths {
            dir: dir.to_path_buf(),
        };
        let req = CreateVm {
            id: format!("template-{size_name}"),
            size: size_name.to_string(),
            metadata: BTreeMap::new(),
            // Far more than a build takes; a builder that died leaves no VM.
            expires_at: OffsetDateTime::now_utc() + TEMPLATE_BUILD_LEASE,
            egress: crate::vm::Egress::open(),
            volumes: Vec::new(),
        };
        let mem = dir.join(template::MEM);
        let booted = self
            .boot(
                &req,
                size,
                &paths,
                &Start::Template { mem: &mem },
                Priority::Normal,
            )
            .await;
        let saved = match booted {
            Ok(ref vm) => save_template(vm).await,
            // Told as such: the build tries once more.
            Err(e @ RuntimeError::BootTimeout { .. }) => {
                Err(crate::vm::explain_boot_timeout(&paths, e).await)
            }
            Err(e) => Err(RuntimeError::Launch(format!(
                "booting the template VM: {e}; last console lines:\n{}",
                console::tail_lines(&paths.console(), 20)
            ))),
        };
        // Whatever happened, nothing of the template VM keeps running.
        match std::fs::read(paths.record())
            .ok()
            .and_then(|b| serde_json::from_slice::<VmRecord>(&b).ok())
        {
            Some(record) => stop_processes(&record, &paths).await,
            None => {
                if let Some(pid) = process::find_by_marker(&dir.display().to_string()) {
                    process::kill_and_wait(pid, &qemu_marker(&req.id), Duration::from_secs(10))
                        .await;
                }
            }
        }
        saved?;
        for f in [
            paths.agent_socket(),
            paths.qmp_socket(),
            paths.record(),
            dir.join("passt.log"),
            dir.join(expiry::EXPIRES_FILE),
        ] {
            let _ = std::fs::remove_file(f);
        }
        Ok(())
    }
}

/// Start loading a template's device state into a QEMU waiting with
/// `-incoming defer`. Only device state is in the file: with `x-ignore-shared`
/// the RAM is the template's file itself. QEMU exits if the load fails.
pub(super) async fn load_template_state(
    paths: &VmPaths,
    template: &Template,
    qemu_pid: u32,
    marker: &str,
) -> Result<()> {
    wait_for_socket(paths, &paths.qmp_socket(), "QMP", qemu_pid, marker).await?;
    let mut qmp = Qmp::connect(&paths.qmp_socket()).await?;
    qmp.ignore_shared_ram().await?;
    qmp.execute(
        "migrate-incoming",
        serde_json::json!({"uri": format!("file:{}", template.state().display())}),
    )
    .await?;
    // Connect to the agent only once the guest runs: a host that connects
    // while the device state is still loading is not seen by the guest
    // (the loaded state says "no host"), and its first bytes go unanswered.
    // A load that fails makes QEMU exit, which closes QMP.
    loop {
        let event = qmp.next_event().await.map_err(|_| {
            RuntimeError::Disconnected(format!(
                "QEMU exited while loading the template's state: {}",
                console::tail_lines(&paths.qemu_log(), 3)
            ))
        })?;
        if event.get("event").and_then(|e| e.as_str()) == Some("RESUME") {
            return Ok(());
        }
    }
}

/// Warm the template guest, let its agent settle, and save the VM's device
/// state next to its RAM file.
async fn save_template(vm: &Vm) -> Result<()> {
    // The first command of every restored sandbox then finds the shell and
    // its libraries in the guest's page cache.
    vm.agent.warm_up().await?;
    vm.agent.close();
    // The agent ends a session 2 s after its host went away; saved after
    // that, every restore starts from an agent waiting for its first host.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let state = vm.paths.dir.join(template::STATE);
    let mut qmp = Qmp::connect(&vm.paths.qmp_socket()).await?;
    // Saved while running (QEMU stops the guest for the last step itself),
    // so the saved run state is "running" and a restore starts the guest as
    // soon as the state is loaded, without another QMP round trip. RAM is not
    // copied at all, so there is nothing to iterate over.
    qmp.ignore_shared_ram().await?;
    qmp.execute(
        "migrate",
        serde_json::json!({"uri": format!("file:{}", state.display())}),
    )
    .await?;
    qmp.wait_migration("saving the template").await
}
