//! `sandpit volume`: an account's volumes on a server (--url,
//! SANDPIT_API_KEY): make one, list them, grow one, move one to another
//! node, delete some. A thin
//! client of `/v1/volumes`: every check is the server's.

use crate::sandbox::{api_error, server, ServerArgs};
use anyhow::Result;
use clap::Subcommand;
use sandpit_core::api::prelude::*;
use sandpit_core::{CreateVolume, ResizeVolume, Volume};

#[derive(Subcommand)]
pub enum VolumeCommand {
    /// Make an empty volume NAME (an ext4 file system on the server's
    /// disk, kept until deleted and billed per GB-month meanwhile)
    Create {
        name: String,
        /// Its size in GiB [default: the server's, 10 unless configured]
        #[arg(long)]
        size_gb: Option<u32>,
        #[command(flatten)]
        server: ServerArgs,
        /// Print the volume as JSON
        #[arg(long)]
        json: bool,
    },
    /// List the account's volumes: name, id, size, status, who mounts it
    #[command(visible_alias = "list")]
    Ls {
        #[command(flatten)]
        server: ServerArgs,
        #[arg(long)]
        json: bool,
    },
    /// Grow volume NAME (or id) to --size-gb GiB; never smaller, and not
    /// while a sandbox mounts it
    Resize {
        name: String,
        #[arg(long)]
        size_gb: u32,
        #[command(flatten)]
        server: ServerArgs,
        #[arg(long)]
        json: bool,
    },
    /// Move volume NAME (or id) to cluster node --to: its file copied
    /// there (streamed), then its sandboxes run there; not while a sandbox
    /// mounts it
    Move {
        name: String,
        /// The node that is to keep it
        #[arg(long)]
        to: String,
        #[command(flatten)]
        server: ServerArgs,
        #[arg(long)]
        json: bool,
    },
    /// Delete volumes (by name or id) and what they hold
    #[command(visible_alias = "delete")]
    Rm {
        #[arg(required = true)]
        names: Vec<String>,
        #[command(flatten)]
        server: ServerArgs,
    },
}

pub async fn run(cmd: VolumeCommand) -> Result<i32> {
    match cmd {
        VolumeCommand::Create {
            name,
            size_gb,
            server: s,
            json,
        } => {
            let (api, caller) = server(&s).await?;
            let req = CreateVolume { name, size_gb };
            let (volume, _) = api
                .create_volume(&caller, req, None)
                .await
                .map_err(api_error)?;
            print_volume(&volume, json)
        }
        VolumeCommand::Ls { server: s, json } => {
            let (api, caller) = server(&s).await?;
            let list = api.list_volumes(&caller).await.map_err(api_error)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                for volume in &list.data {
                    println!("{}", line(volume));
                }
            }
            Ok(0)
        }
        VolumeCommand::Resize {
            name,
            size_gb,
            server: s,
            json,
        } => {
            let (api, caller) = server(&s).await?;
            let volume = api
                .resize_volume(&caller, &name, ResizeVolume { size_gb })
                .await
                .map_err(api_error)?;
            print_volume(&volume, json)
        }
        VolumeCommand::Move {
            name,
            to,
            server: s,
            json,
        } => {
            let (api, caller) = server(&s).await?;
            let volume = api
                .move_volume(&caller, &name, &to)
                .await
                .map_err(api_error)?;
            print_volume(&volume, json)
        }
        VolumeCommand::Rm { names, server: s } => {
            let (api, caller) = server(&s).await?;
            for name in names {
                api.delete_volume(&caller, &name).await.map_err(api_error)?;
                println!("{name}");
            }
            Ok(0)
        }
    }
}

fn print_volume(volume: &Volume, json: bool) -> Result<i32> {
    match json {
        true => println!("{}", serde_json::to_string_pretty(volume)?),
        false => println!("{}", line(volume)),
    }
    Ok(0)
}

/// A volume on one line: name, id, size, status, and where it is mounted
/// (`sbx_…:/path[:ro]`, or `-`).
fn line(volume: &Volume) -> String {
    let mounts: Vec<String> = volume
        .mounted_by
        .iter()
        .map(|m| {
            let ro = if m.read_only { ":ro" } else { "" };
            format!("{}:{}{ro}", m.sandbox_id, m.path)
        })
        .collect();
    format!(
        "{}\t{}\t{} GiB\t{}\t{}",
        volume.name,
        volume.id,
        volume.size_gb,
        volume.status,
        if mounts.is_empty() {
            "-".to_string()
        } else {
            mounts.join(",")
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandpit_core::VolumeHolder;

    #[test]
    fn a_volume_is_one_line_naming_where_it_is_mounted() {
        let mut v = Volume {
            object: "volume".into(),
            id: "vol_1".into(),
            name: "data".into(),
            size_gb: 10,
            status: "ready".into(),
            created_at: "2026-12-07T08:00:00Z".into(),
            mounted_by: Vec::new(),
        };
        assert_eq!(line(&v), "data\tvol_1\t10 GiB\tready\t-");
        v.mounted_by = vec![
            VolumeHolder {
                sandbox_id: "sbx_a".into(),
                path: "/data".into(),
                read_only: false,
            },
            VolumeHolder {
                sandbox_id: "sbx_b".into(),
                path: "/in".into(),
                read_only: true,
            },
        ];
        assert!(
            line(&v).ends_with("\tsbx_a:/data,sbx_b:/in:ro"),
            "{}",
            line(&v)
        );
    }
}
