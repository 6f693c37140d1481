//! Launching a VM's QEMU: the disk checks, the guest's configuration, the
//! network helper and the deny list, QEMU's command line, and the wait for
//! the agent (a cold boot, or a restore from a template or a save).

use super::templates::load_template_state;
use super::*;

/// A template's boot gets this many times the boot bound (see `boot`).
const TEMPLATE_BOOT_FACTOR: u32 = 3;

impl VmManager {
    pub(super) async fn boot(
        &self,
        req: &CreateVm,
        size: SizeSpec,
        paths: &VmPaths,
        start: &Start<'_>,
        priority: Priority,
    ) -> Result<Vm> {
        let setup_started = Instant::now();
        let base = match start {
            Start::Restore(t) => t.disk(),
            Start::Saved(saved) => saved.disk(),
            Start::Cold | Start::Template { .. } => self.image.rootfs.clone(),
        };
        // A save's layer is named by nothing of this VM until its overlay
        // exists: the layers' collection waits (see `layers`).
        let layer_lock = match start {
            Start::Saved(saved) => {
                let lock = crate::save::layers::lock(&self.layers_lock()).await?;
                if !base.is_file() {
                    return Err(RuntimeError::Launch(format!(
                        "the save {} was deleted",
                        saved.name
                    )));
                }
                Some(lock)
            }
            _ => None,
        };
        create_overlay(&base, &paths.disk(), size.disk_gb).await?;
        drop(layer_lock);

        // A template runs no user code and must write its state file.
        let run_as = if nix::unistd::geteuid().is_root() && !matches!(start, Start::Template { .. })
        {
            Some(self.vm_uid(&req.id))
        } else {
            None
        };
        let passt = if self.config.network.enabled {
            // The host's guard is in place before passt can send anything.
            if let Some(uid) = run_as {
                std::fs::write(paths.uid_file(), uid.to_string())
                    .map_err(RuntimeError::io("writing the VM's uid"))?;
                // `nft` takes ~25 ms: off the async workers, which a burst
                // of starts would otherwise stall.
                let redirect = self.egress_proxy(&req.id, &req.egress).await?;
                let plan = self.guard_plan(&req.egress, redirect);
                tokio::task::spawn_blocking(move || guard::install(uid, &plan))
                    .await
                    .map_err(|e| RuntimeError::Launch(format!("the guard's task: {e}")))??;
            }
            Some(net::start_passt(
                &self.config.passt_binary,
                &paths.dir,
                self.config.ksm,
                run_as,
            )?)
        } else {
            None
        };
        {
            use std::os::unix::fs::PermissionsExt;
            // Only root (the runtime) and this VM's QEMU walk into a VM's
            // directory: QEMU reopens its disk by path after it dropped to its
            // own uid (when a restore activates the block devices), so the
            // directory is group-owned by that uid's group, 0710, and the
            // overlay belongs to the uid alone.
            match run_as {
                Some(uid) => {
                    let _ = std::os::unix::fs::chown(&paths.dir, Some(0), Some(uid));
                    let _ = std::fs::set_permissions(
                        &paths.dir,
                        std::fs::Permissions::from_mode(0o710),
                    );
                    let _ = std::os::unix::fs::chown(paths.disk(), Some(uid), Some(uid));
                    let _ = std::fs::set_permissions(
                        paths.disk(),
                        std::fs::Permissions::from_mode(0o600),
                    );
                }
                None => {
                    let _ = std::fs::set_permissions(
                        &paths.dir,
                        std::fs::Permissions::from_mode(0o700),
                    );
                }
            }
        }
        // The expiry is in place before anything could outlive us.
        expiry::write_expiry(&paths.dir, req.expires_at)?;
        let (life_read, life_write) = expiry::life_pipe()?;
        // A start from a save maps the save's RAM image (see `ram_image`).
        // Where the host cannot make one, its pages are written instead.
        let ram_image = match start {
            Start::Saved(saved) => match self
                .ram_images
                .get(
                    saved.ram().ok_or_else(|| {
                        RuntimeError::Launch(format!(
                            "the save {} holds no RAM of its own",
                            saved.name
                        ))
                    })?,
                    saved.template.mem(),
                    crate::save::saved::RAM_BLOCK,
                    saved.record.from != req.id,
                )
                .await?
            {
                Some(file) => Some(expiry::above_targets(crate::save::ram_image::descriptor(
                    &file,
                )?)?),
                None => None,
            },
            _ => None,
        };
        let mapped = ram_image.is_some();
        let given = Given {
            network: passt.is_some(),
            run_as,
            ram_image: mapped,
        };
        let args = self.qemu_args(req, size, paths, start, given);
        tracing::debug!(id = %req.id, "starting QEMU: {}", args.join(" "));
        let qemu_log = std::fs::File::create(paths.qemu_log())
            .map_err(RuntimeError::io("creating qemu.log"))?;
        let mut cmd = tokio::process::Command::new(&self.config.qemu_binary);
        cmd.args(&args)
            // Its sockets are named relative to it (see `AGENT_SOCKET`).
            .current_dir(&paths.dir)
            .stdin(Stdio::null())
            .stdout(qemu_log.try_clone().map_err(RuntimeError::io("qemu.log"))?)
            .stderr(qemu_log)
            .kill_on_drop(false);
        let net_fd = passt.as_ref().map(|p| p.1.as_raw_fd());
        let life_fd = life_write.as_raw_fd();
        let ram_image_fd = ram_image.as_ref().map(|fd| fd.as_raw_fd());
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                libc::setsid();
                process::apply_priority_to_self(priority);
                // QEMU asks for huge pages on its translation cache, so each
                // partly filled 4 MiB region of it costs 2 MiB at once: about
                // 4 MiB more per idle VM. Guest RAM is a file mapping and
                // does not use them anyway.
                libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
                // Guests' memory is overcommitted (see `sandpit_core`'s
                // capacity): should the host run out anyway, its OOM killer
                // takes a VM, never the server or its database.
                let adj = c"/proc/self/oom_score_adj";
                let fd = libc::open(adj.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd >= 0 {
                    libc::write(
                        fd,
                        QEMU_OOM_SCORE_ADJ.as_ptr().cast(),
                        QEMU_OOM_SCORE_ADJ.len(),
                    );
                    libc::close(fd);
                }
                if let Some(fd) = net_fd {
                    net::pass_fd(fd, net::NET_FD)?;
                }
                // The watchdog's pipe: QEMU is its only writer, so its exit
                // is the pipe's end. Second: `life_fd` (like the image's)
                // is above every target.
                net::pass_fd(life_fd, expiry::QEMU_LIFE_FD)?;
                if let Some(fd) = ram_image_fd {
                    net::pass_fd(fd, RAM_IMAGE_FD)?;
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(RuntimeError::spawn(
            self.config.qemu_binary.display().to_string(),
            "qemu-system-x86",
            "starting QEMU",
        ))?;
        let qemu_pid = child.id().unwrap_or(0);
        let spawned = Instant::now();
        let giving_way = match priority {
            Priority::Background => self.give_way.track(qemu_pid),
            Priority::Normal => None,
        };
        // QEMU holds its end of the network pair now; passt must see it close
        // when QEMU exits, so the parent keeps no copy.
        let passt = passt.map(|(pid, fd)| {
            drop(fd);
            pid
        });
        drop(child); // tokio reaps it if it exits while we live; we track it by pid.
        drop(life_write);
        drop(ram_image);
        let passt_started = passt.and_then(process::start_time);
        let at_expiry = match start {
            Start::Template { .. } => expiry::AtExpiry::Keep,
            _ => expiry::AtExpiry::Remove,
        };
        let watchdog = expiry::start_watchdog(
            &paths.dir,
            &req.id,
            qemu_pid,
            passt.zip(passt_started),
            at_expiry,
            life_read,
        );

        // A machine is the same machine when it comes back from its own
        // save (restored, resumed): its machine-id stays. Any other VM gets
        // one of its own.
        let machine_id = match start {
            Start::Saved(saved) if saved.record.from == req.id => saved.record.machine_id.clone(),
            _ => None,
        }
        .unwrap_or_else(|| {
            let mut id = [0u8; 16];
            rand::rngs::OsRng.fill_bytes(&mut id);
            hex::encode(id)
        });
        let mut record = VmRecord {
            id: req.id.clone(),
            size: req.size.clone(),
            resources: size,
            accel: self.accel,
            image_id: self.image.id.clone(),
            kernel_release: self.image.kernel_release.clone(),
            created_at: OffsetDateTime::now_utc(),
            ready_at: None,
            qemu_pid,
            passt_pid: passt,
            passt_started,
            qemu_uid: run_as,
            metadata: req.metadata.clone(),
            template: match start {
                Start::Restore(t) => Some(t.key.clone()),
                Start::Saved(saved) => Some(saved.template.key.clone()),
                _ => None,
            },
            watchdog: watchdog.as_ref().ok().copied(),
            disk: None,
            machine_id: Some(machine_id.clone()),
            ram_base: match start {
                Start::Saved(saved) => saved.record.ram.clone(),
                _ => None,
            },
            ram_mapped: match start {
                Start::Saved(saved) if mapped => saved.record.ram.clone(),
                _ => None,
            },
            egress: req.egress.clone(),
            volumes: Vec::new(),
        };
        write_record(paths, &record)?;
        // Recorded first, so a failed start's clean-up stops QEMU and passt.
        watchdog?;

        // Wait for the agent socket, then the handshake, while watching QEMU.
        let marker = qemu_marker(&req.id);
        let exited = process::pidfd_open(qemu_pid);
        let boot_timeout = match start {
            // A restore answers in well under a second; one that has not in
            // 20 s is on a host too busy for another VM (see `create`).
            Start::Restore(_) | Start::Saved(_) => {
                self.config.boot_timeout.min(Duration::from_secs(20))
            }
            // Nobody waits on a template's boot, and once it is built every
            // start is a restore: on a host so busy that a boot takes over
            // its bound (CI's, at a load of 10: the guest kernel 12 s into
            // its boot after a minute), the build still gets there.
            Start::Template { .. } => self.config.boot_timeout * TEMPLATE_BOOT_FACTOR,
            Start::Cold => self.config.boot_timeout,
        };
        let connect = async {
            wait_for_socket(paths, &paths.agent_socket(), "agent", qemu_pid, &marker).await?;
            AgentClient::connect(&paths.agent_socket(), boot_timeout).await
        };
        // A save whose memory has volumes mounted is started with them
        // (a resume): the same ones, in the same slots.
        let mounted = match start {
            Start::Saved(saved) => saved.record.volumes.clone(),
            _ => Vec::new(),
        };
        if !mounted.is_empty() && mounted != req.volumes {
            return Err(RuntimeError::Launch(format!(
                "the save has volumes mounted ({mounted:?}): a VM from it holds those, not {:?}",
                req.volumes
            )));
        }
        let reopened = match start {
            Start::Saved(saved) => self.open_volumes(&paths.dir, &saved.dir, &mounted).await?,
            _ => Vec::new(),
        };
        let load = async {
            match start {
                Start::Restore(t) => load_template_state(paths, t, qemu_pid, &marker).await,
                Start::Saved(saved) => {
                    crate::save::saved::load_saved_state(
                        paths, saved, qemu_pid, &marker, mapped, reopened,
                    )
                    .await
                }
                Start::Cold | Start::Template { .. } => Ok(()),
            }
        };
        tokio::time::timeout(boot_timeout, load)
            .await
            .map_err(|_| RuntimeError::BootTimeout {
                secs: boot_timeout.as_secs(),
                console_tail: String::new(),
            })??;
        let loaded = spawned.elapsed();
        let agent = match exited {
            Some(fd) => tokio::select! {
                r = connect => r?,
                _ = process::wait_pidfd(fd) => {
                    return Err(RuntimeError::Disconnected("QEMU exited during boot".into()))
                }
            },
            None => connect.await?,
        };
        let answered = spawned.elapsed();

        let mut entropy = vec![0u8; 64];
        rand::rngs::OsRng.fill_bytes(&mut entropy);
        let network = passt.as_ref().map(|_| self.network_config(&req.egress));
        // The guest sets its clock from the time read here: no stop for
        // live work in between.
        let setting_the_clock = giving_way.as_ref().map(|t| t.unstoppable());
        let hostname = match start {
            Start::Template { .. } => "sandpit-template".into(),
            _ => hostname_for(&req.id),
        };
        agent
            .configure(
                self.guest_config(hostname, machine_id, network, &req.egress),
                &entropy,
                // What is left of the boot's bound, and at least a reply's.
                boot_timeout
                    .saturating_sub(spawned.elapsed())
                    .max(crate::channel::REPLY_DEADLINE),
            )
            .await?;
        drop(setting_the_clock);
        if priority == Priority::Normal && !matches!(start, Start::Template { .. }) {
            // A VM made ahead of demand is checked when it is handed out,
            // at normal priority (see `LocalVms::create`).
            agent.settle_clock(&req.id).await;
        }
        if !mounted.is_empty() {
            record.volumes = mounted;
            write_record(paths, &record)?;
        }
        if !req.volumes.is_empty() {
            self.mount_volumes(&req.id, &agent, &req.volumes).await?;
            record.volumes = req.volumes.clone();
        }
        let configured = spawned.elapsed();
        if priority == Priority::Background && !matches!(start, Start::Template { .. }) {
            // A VM made ahead of demand runs one command before it is handed
            // out, so this QEMU has translated the shell's code and the
            // user's first command is as quick as any other.
            agent.warm_up().await?;
        }
        let times = StartTimes {
            set_up: setup_started.elapsed().saturating_sub(spawned.elapsed()),
            state_loaded: loaded,
            agent_answered: answered,
            configured,
        };
        tracing::debug!(
            id = %req.id,
            "started in {} ms (state loaded {} ms, agent {} ms, configured {} ms) after {} ms of set-up",
            spawned.elapsed().as_millis(),
            times.state_loaded.as_millis(),
            times.agent_answered.as_millis(),
            times.configured.as_millis(),
            times.set_up.as_millis(),
        );
        record.ready_at = Some(OffsetDateTime::now_utc());
        write_record(paths, &record)?;
        Ok(Vm {
            record,
            paths: paths.clone(),
            agent,
            start_times: Some(times),
        })
    }

    /// What a guest is configured with: its identity and network, this
    /// host's limits and CAs (and its own broker's, when `egress` brokers
    /// secrets), and the clock as read now.
    pub(super) fn guest_config(
        &self,
        hostname: String,
        machine_id: String,
        network: Option<NetworkConfig>,
        egress: &Egress,
    ) -> GuestConfig {
        let mut ca_certificates = self.ca_certificates.clone();
        if let (Some(broker), Some(_)) = (&egress.broker, &network) {
            ca_certificates.push(broker.ca.cert_pem.clone());
        }
        GuestConfig {
            hostname,
            machine_id,
            time_unix_ms: (OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as u64,
            network,
            user_pids_max: self.config.user_pids_max,
            reserved_memory_mb: self.config.reserved_memory_mb,
            ca_certificates,
        }
    }

    /// What the host denies the passt of a guest with `egress` (see
    /// `guard`): what its own filter denies, with the same exemptions, then
    /// the sandbox's own lists' addresses and prefixes, its connections to
    /// ports 80 and 443 sent to its egress proxy on `redirect` when the
    /// lists name hosts.
    pub(super) fn guard_plan(&self, egress: &Egress, redirect: Option<u16>) -> guard::GuardPlan {
        if egress.is_blocked() {
            return guard::GuardPlan {
                deny: vec![Egress::EVERYTHING.into()],
                ..guard::GuardPlan::default()
            };
        }
        let dns = self.guest_name_servers();
        // A sandbox with lists of its own does not get the operator's proxy
        // past them: through it, it would reach any host, whatever its
        // lists say (the proxy's address is one destination like others).
        let proxy = match egress.allow.is_empty() && egress.deny.is_empty() {
            true => self
                .proxy
                .as_ref()
                .and_then(|p| Some((p.address.parse().ok()?, p.port))),
            false => None,
        };
        guard::GuardPlan {
            deny: self.deny.clone(),
            dns,
            proxy,
            then_allow: egress.allow_prefixes(),
            then_deny: egress.deny_prefixes(),
            redirect: redirect.filter(|_| egress.needs_proxy()),
            filter_dns: egress.has_names(),
        }
    }

    /// The name servers a guest's lookups end at: the `[network] dns`
    /// servers, else the host's resolver, which passt forwards to (read
    /// now, as passt reads it at its start).
    pub(super) fn guest_name_servers(&self) -> Vec<std::net::IpAddr> {
        match &self.config.network.dns {
            Some(servers) => servers.iter().filter_map(|s| s.parse().ok()).collect(),
            None => {
                let conf = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
                net::host_resolver(&conf)
                    .map(std::net::IpAddr::V4)
                    .into_iter()
                    .collect()
            }
        }
    }

    /// The network a guest with `egress` is configured with: its filter
    /// holds the sandbox's lists too, so that a denied connect fails at
    /// once (the host's guard enforces them; passt lets a connect the guard
    /// refuses time out in the guest). Without an allow list the deny list
    /// is part of `deny`, which an agent of any generation applies. Lists
    /// that name hosts leave ports 80 and 443 to the host's egress proxy.
    pub(super) fn network_config(&self, egress: &Egress) -> NetworkConfig {
        if egress.is_blocked() {
            // No name server: a lookup then fails at once (nothing answers
            // on the guest's loopback) instead of timing out on a filter.
            return NetworkConfig {
                address: net::GUEST_ADDRESS.into(),
                gateway: net::GUEST_GATEWAY.into(),
                dns: Vec::new(),
                deny: vec![Egress::EVERYTHING.into()],
                allow: Vec::new(),
                then_deny: Vec::new(),
                proxied_ports: Vec::new(),
                mtu: net::GUEST_MTU,
                proxy: None,
            };
        }
        let mut deny = self.deny.clone();
        let named = egress.has_names();
        let (allow, then_deny) = match egress.allow_prefixes().is_empty() && !named {
            true => {
                deny.extend(egress.deny_prefixes());
                (Vec::new(), Vec::new())
            }
            false => (egress.allow_prefixes(), egress.deny_prefixes()),
        };
        // Without root there is no guard and no proxy: the guest's filter
        // then refuses those ports by the lists' addresses alone (a name
        // allows nothing), rather than let them out unchecked.
        let proxied_ports = match egress.needs_proxy() && nix::unistd::geteuid().is_root() {
            true => guard::PROXIED_PORTS.to_vec(),
            false => Vec::new(),
        };
        let unrestricted = egress.allow.is_empty() && egress.deny.is_empty();
        NetworkConfig {
            address: net::GUEST_ADDRESS.into(),
            gateway: net::GUEST_GATEWAY.into(),
            dns: self
                .config
                .network
                .dns
                .clone()
                .unwrap_or_else(|| vec![net::GUEST_DNS_FORWARD.into()]),
            deny,
            allow,
            then_deny,
            proxied_ports,
            mtu: net::GUEST_MTU,
            proxy: self.proxy.clone().filter(|_| unrestricted),
        }
    }

    fn qemu_args(
        &self,
        req: &CreateVm,
        size: SizeSpec,
        paths: &VmPaths,
        start: &Start<'_>,
        given: Given,
    ) -> Vec<String> {
        let Given {
            network,
            run_as,
            ram_image: mapped,
        } = given;
        let p = |p: PathBuf| p.display().to_string();
        let mut machine = machine_type(self.accel);
        // Template and restored VMs keep guest RAM in the template's file:
        // shared while the template is made, a private copy-on-write mapping
        // of the read-only file in each restored VM (`rom=off` keeps the
        // mapping writable although the file is opened read-only, so no VM
        // can write the pages others share).
        let ram = match start {
            Start::Cold => None,
            Start::Template { mem } => Some(format!(
                "memory-backend-file,id=ram,size={}M,mem-path={},share=on",
                size.memory_mb,
                mem.display()
            )),
            Start::Restore(t) => Some(format!(
                "memory-backend-file,id=ram,size={}M,mem-path={},share=off,readonly=on,rom=off",
                size.memory_mb,
                t.mem().display()
            )),
            // The save's RAM image, which QEMU holds at `RAM_IMAGE_FD`.
            Start::Saved(_) if mapped => Some(format!(
                "memory-backend-file,id=ram,size={}M,mem-path=/proc/self/fd/{RAM_IMAGE_FD},share=off,readonly=on,rom=off",
                size.memory_mb,
            )),
            // The same base as the VM that was saved, its pages written
            // over it (see `ram_pages`).
            Start::Saved(saved) => Some(format!(
                "memory-backend-file,id=ram,size={}M,mem-path={},share=off,readonly=on,rom=off",
                size.memory_mb,
                saved.template.mem().display()
            )),
        };
        if ram.is_some() {
            machine.push_str(",memory-backend=ram");
        }
        let mut a: Vec<String> = vec![
            "-name".into(),
            format!("{},process={}", qemu_marker(&req.id), qemu_marker(&req.id)),
            "-M".into(),
            machine,
        ];
        if let Some(ram) = ram {
            a.push("-object".into());
            a.push(ram);
        }
        if let Start::Restore(_) | Start::Saved(_) = start {
            // The state is loaded through QMP once its capabilities are set
            // (see `load_template_state`, `saved::load_saved_state`).
            a.push("-incoming".into());
            a.push("defer".into());
        }
        if let Start::Saved(_) = start {
            // A save's devices are QEMU's `xen-save-devices-state` stream,
            // which has no configuration section (see `saved`).
            a.push("-global".into());
            a.push("migration.send-configuration=off".into());
        }
        match self.accel {
            Accel::Tcg => {
                a.push("-accel".into());
                a.push(format!("tcg,tb-size={}", self.config.tcg_tb_size_mb));
                a.push("-cpu".into());
                a.push("max".into());
            }
            Accel::Kvm => {
                a.push("-accel".into());
                a.push("kvm".into());
                a.push("-cpu".into());
                a.push("host".into());
            }
        }
        a.extend(
            [
                "-smp",
                &size.vcpus.to_string(),
                "-m",
                &format!("{}M", size.memory_mb),
                "-nodefaults",
                "-no-user-config",
                "-display",
                "none",
                "-no-reboot",
                "-chardev",
                &format!("file,id=console,path={},append=on", p(paths.console())),
                "-serial",
                "chardev:console",
                "-device",
                "virtio-serial-device",
                "-chardev",
                // Relative to QEMU's working directory, the VM's (see
                // `AGENT_SOCKET`): short whatever the data directory's path.
                &format!("socket,id=agent,path={AGENT_SOCKET},server=on,wait=off"),
                "-device",
                &format!("virtserialport,chardev=agent,name={AGENT_PORT_NAME}"),
                "-qmp",
                &format!("unix:{QMP_SOCKET},server=on,wait=off"),
                "-drive",
                &format!(
                    "id=root,file={},format=qcow2,if=none,discard=unmap,{}",
                    p(paths.disk()),
                    super::host_disk::WRITE_ERRORS
                ),
                "-device",
                "virtio-blk-device,drive=root",
                "-object",
                "rng-random,id=rng0,filename=/dev/urandom",
                "-device",
                "virtio-rng-device,rng=rng0",
                "-kernel",
                &p(match start {
                    Start::Restore(t) => t.kernel_stub(),
                    Start::Saved(saved) => saved.template.kernel_stub(),
                    _ => self.image.kernel.clone(),
                }),
                "-initrd",
                &p(self.image.initrd.clone()),
                "-append",
                &kernel_cmdline(self.accel, crate::host::accel::host_tsc_khz()),
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        // The devices a restored VM had when its state was saved.
        let slots = match start {
            Start::Restore(t) => t.record.inputs.volume_slots,
            Start::Saved(saved) => saved.template.record.inputs.volume_slots,
            Start::Cold | Start::Template { .. } => super::volumes::VOLUME_SLOTS,
        };
        a.extend(super::volumes::slot_args(slots));
        if network {
            a.push("-netdev".into());
            a.push(format!(
                "stream,id=net0,server=off,addr.type=fd,addr.str={}",
                net::NET_FD
            ));
            a.push("-device".into());
            a.push("virtio-net-device,netdev=net0".into());
        }
        // seccomp: no spawning, no obsolete calls, no resource control. The
        // set*id calls stay allowed only when QEMU must drop to its own uid
        // (the filter is installed before the drop); once it runs as that
        // unprivileged uid it cannot raise itself again anyway.
        a.push("-sandbox".into());
        a.push(format!(
            "on,obsolete=deny,spawn=deny,resourcecontrol=deny,elevateprivileges={}",
            if run_as.is_some() { "allow" } else { "deny" }
        ));
        if let Some(uid) = run_as {
            if self.qemu_version.major >= 9 {
                a.push("-run-with".into());
                a.push(format!("user={uid}:{uid}"));
            } else {
                a.push("-runas".into());
                a.push(format!("{uid}:{uid}"));
            }
        }
        a
    }

    /// An unprivileged uid for this VM's QEMU, not used by any other live VM:
    /// the one VM `id` would run as if it started now.
    pub fn vm_uid(&self, id: &str) -> u32 {
        const BASE: u32 = 3_000_000;
        const SPAN: u32 = 1_000_000;
        let used: Vec<u32> = self.list().iter().filter_map(|r| r.qemu_uid).collect();
        let mut h: u32 = id
            .bytes()
            .fold(2166136261u32, |h, b| (h ^ b as u32).wrapping_mul(16777619));
        loop {
            let uid = BASE + h % SPAN;
            if !used.contains(&uid) {
                return uid;
            }
            h = h.wrapping_add(1);
        }
    }
}

/// Says where the guests' DNS goes by default (see `net`), and warn when it
/// goes nowhere.
pub(super) fn log_guest_resolver() {
    let conf = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    match net::host_resolver(&conf) {
        Some(upstream) => tracing::debug!(
            "guests resolve names at {}, which passt forwards to {upstream} \
             (the first IPv4 nameserver of /etc/resolv.conf)",
            net::GUEST_DNS_FORWARD
        ),
        None => tracing::warn!(
            "/etc/resolv.conf names no IPv4 nameserver, so guests cannot resolve names; \
             name servers for them can be set with [network] dns"
        ),
    }
}

/// Wait until a starting QEMU has created `socket` (its `what` socket),
/// failing as soon as QEMU exits, or after 10 s.
pub(crate) async fn wait_for_socket(
    paths: &VmPaths,
    socket: &Path,
    what: &str,
    qemu_pid: u32,
    marker: &str,
) -> Result<()> {
    let start = Instant::now();
    while !socket.exists() {
        if !process::alive_with_marker(qemu_pid, marker) {
            return Err(RuntimeError::Disconnected("QEMU exited at start".into()));
        }
        if start.elapsed() > Duration::from_secs(10) {
            return Err(RuntimeError::Launch(format!(
                "QEMU did not create its {what} socket: {}",
                console::tail_lines(&paths.qemu_log(), 5)
            )));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(())
}
