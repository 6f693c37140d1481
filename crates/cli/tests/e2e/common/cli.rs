//! The `sandpit` command line as a person uses it: each call is a separate
//! process on one data directory, with a small size table.

use super::{data_dir, images_dir};
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, Output};

pub struct Cli {
    pub data: PathBuf,
    pub config: PathBuf,
}

impl Cli {
    pub fn new() -> Cli {
        let data = data_dir();
        let config = data.join("config.toml");
        std::fs::write(
            &config,
            // Three minutes to boot, as the test servers have (serve::CONFIG).
            "boot_timeout_secs = 180\n[sizes.small]\nvcpus = 2\nmemory_mb = 1024\ndisk_gb = 4\n",
        )
        .unwrap();
        Cli { data, config }
    }

    /// The `sandpit` binary under test.
    pub fn program() -> &'static str {
        env!("CARGO_BIN_EXE_sandpit")
    }

    /// The arguments every call starts with: this data directory, the
    /// images and the config.
    pub fn base_args(&self) -> Vec<OsString> {
        vec![
            "--data-dir".into(),
            self.data.clone().into(),
            "--images-dir".into(),
            images_dir().into(),
            "--config".into(),
            self.config.clone().into(),
        ]
    }

    /// One call, as a person types it: from the data directory's parent,
    /// naming it relative to there (a relative data directory once broke
    /// every restore: QEMU read the template's path relative to the disk).
    pub fn run(&self, args: &[&str]) -> Output {
        let mut base = self.base_args();
        base[1] = self.data.file_name().unwrap().into();
        Command::new(Self::program())
            .current_dir(self.data.parent().unwrap())
            .args(base)
            .args(args)
            // Found beside the binary, as an install finds it.
            .env_remove("SANDPIT_AGENT_BIN")
            .output()
            .unwrap()
    }

    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "sandpit {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}
