//! `sandpit template`: build a template from a Dockerfile on a server
//! (its `COPY` files packed here and uploaded first), follow the build's
//! log, list, show and delete builds; and, for an operator, publish one to
//! every account.
//!
//! A `COPY`'s files are packed into a tar laid out as they are to stand
//! under one directory of the guest, with every time and owner zeroed and
//! entries sorted: the same files make the same archive, so its SHA-256
//! (which names it, and enters the step's cache key) changes only when
//! their content, names or modes do.

use crate::sandbox::{api_error, server, ServerArgs};
use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Subcommand};
use sandpit_core::api::prelude::*;
use sandpit_core::BuildTemplate;
use sandpit_server::serve::open_store;
use sandpit_server::settings::Settings;
use sandpit_templates::dockerfile::{self, CopyRequest, PackedCopy};
use sha2::Digest;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Subcommand)]
pub enum TemplateCommand {
    /// Build template NAME[:TAG] from a Dockerfile on a server (--url,
    /// SANDPIT_API_KEY), following its log; prints the build's id
    Build(BuildArgs),
    /// List a server's templates (the account's and published ones)
    Ls {
        #[command(flatten)]
        server: ServerArgs,
        #[arg(long)]
        json: bool,
    },
    /// Show a build (by id, or the newest of NAME[:TAG]) and its log
    Show {
        id: String,
        #[command(flatten)]
        server: ServerArgs,
        #[arg(long)]
        json: bool,
    },
    /// Delete template builds (by id)
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
        #[command(flatten)]
        server: ServerArgs,
    },
    /// (operator) Publish an account's NAME[:TAG] to every account of the
    /// data directory's database, or withdraw it (--withdraw)
    Publish {
        reference: String,
        /// The account that built it
        #[arg(long)]
        account: String,
        #[arg(long)]
        withdraw: bool,
    },
}

#[derive(Args)]
pub struct BuildArgs {
    /// NAME or NAME:TAG (tag `latest` by default)
    name: String,
    /// The Dockerfile
    #[arg(short = 'f', long = "file", default_value = "Dockerfile")]
    file: PathBuf,
    /// A template Sandpit carries instead of a Dockerfile:
    /// `code-interpreter` (Jupyter's Python kernel behind the API of E2B's
    /// code-interpreter SDK, on port 49999)
    #[arg(long, value_name = "PRESET", conflicts_with_all = ["file", "context"])]
    preset: Option<String>,
    /// Where COPY's sources are [default: the Dockerfile's directory]
    #[arg(long)]
    context: Option<PathBuf>,
    /// The ready check (over the Dockerfile's HEALTHCHECK)
    #[arg(long)]
    ready: Option<String>,
    /// How long the ready check may take to pass, in seconds [default: 300]
    #[arg(long)]
    ready_timeout: Option<u32>,
    /// The size its sandboxes have [default: the server's]
    #[arg(long)]
    size: Option<String>,
    /// A value for the Dockerfile's ARG NAME
    #[arg(long = "build-arg", value_name = "NAME=VALUE")]
    build_args: Vec<String>,
    /// Run every step again, whatever the cache holds
    #[arg(long)]
    no_cache: bool,
    /// Print the finished build as JSON
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    server: ServerArgs,
}

pub async fn run(settings: &Settings, cmd: TemplateCommand) -> Result<i32> {
    match cmd {
        TemplateCommand::Build(args) => build(args).await,
        TemplateCommand::Ls { server: s, json } => {
            let (api, caller) = server(&s).await?;
            let list = api.list_templates(&caller).await.map_err(api_error)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                for t in &list.data {
                    println!(
                        "{}\t{}:{}\t{}\t{}{}",
                        t.id,
                        t.name,
                        t.tag,
                        t.size,
                        t.status,
                        if t.public { "\tpublic" } else { "" }
                    );
                }
            }
            Ok(0)
        }
        TemplateCommand::Show {
            id,
            server: s,
            json,
        } => {
            let (api, caller) = server(&s).await?;
            let t = api.get_template(&caller, &id).await.map_err(api_error)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&t)?);
            } else {
                print!("{}", t.log.clone().unwrap_or_default());
                println!("{} {}:{} {}", t.id, t.name, t.tag, t.status);
            }
            Ok(0)
        }
        TemplateCommand::Rm { ids, server: s } => {
            let (api, caller) = server(&s).await?;
            for id in ids {
                api.delete_template(&caller, &id).await.map_err(api_error)?;
                println!("{id}");
            }
            Ok(0)
        }
        TemplateCommand::Publish {
            reference,
            account,
            withdraw,
        } => {
            let store = open_store(settings).await?;
            let owner = store
                .account_by_name(&account)
                .await?
                .ok_or_else(|| anyhow!("no account named {account:?}"))?;
            let (name, tag) = sandpit_core::parse_template_reference(&reference)
                .map_err(|e| anyhow!("{}", e.message))?;
            let n = store
                .publish_template(&owner.id, &name, &tag, !withdraw)
                .await?;
            if n == 0 {
                bail!("account {account:?} has no template {name}:{tag}");
            }
            eprintln!(
                "{name}:{tag} ({n} build(s)) is {}",
                if withdraw {
                    "its account's alone again"
                } else {
                    "published to every account"
                }
            );
            Ok(0)
        }
    }
}

/// The templates Sandpit carries (`templates/` in its source): each a
/// Dockerfile and the files it copies, by name.
const PRESETS: &[(&str, &[(&str, &str)])] = &[(
    "code-interpreter",
    &[
        (
            "Dockerfile",
            include_str!("../../../templates/code-interpreter/Dockerfile"),
        ),
        (
            "server.py",
            include_str!("../../../templates/code-interpreter/server.py"),
        ),
    ],
)];

/// A preset's files written to a directory of their own (a build context,
/// removed when dropped).
fn preset_context(name: &str) -> Result<tempfile::TempDir> {
    let (_, files) = PRESETS.iter().find(|(n, _)| *n == name).ok_or_else(|| {
        anyhow!(
            "no preset {name:?}: the presets are {}",
            PRESETS
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    let dir = tempfile::tempdir()?;
    for (file, text) in *files {
        std::fs::write(dir.path().join(file), text)?;
    }
    Ok(dir)
}

async fn build(mut args: BuildArgs) -> Result<i32> {
    let _preset = match &args.preset {
        Some(name) => {
            let dir = preset_context(name)?;
            args.file = dir.path().join("Dockerfile");
            Some(dir)
        }
        None => None,
    };
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let mut build_args = BTreeMap::new();
    for a in &args.build_args {
        let (k, v) = a
            .split_once('=')
            .ok_or_else(|| anyhow!("--build-arg {a}: expected NAME=VALUE"))?;
        build_args.insert(k.to_string(), v.to_string());
    }
    let parsed = dockerfile::parse(&text, &build_args)
        .map_err(|e| anyhow!("{}: {e}", args.file.display()))?;
    for note in &parsed.notes {
        eprintln!("{}: {note}", args.file.display());
    }
    let context = match &args.context {
        Some(c) => c.clone(),
        None => args
            .file
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(".")),
    };
    let (api, caller) = server(&args.server).await?;
    let mut packed = Vec::new();
    for copy in &parsed.copies {
        let (tar, dir) = pack(&context, copy)?;
        let sha = hex::encode(sha2::Sha256::digest(&tar));
        api.upload_template_files(&caller, &sha, tar)
            .await
            .map_err(api_error)?;
        packed.push(PackedCopy { files: sha, dir });
    }
    let spec = parsed.into_spec(&packed).map_err(|e| anyhow!("{e}"))?;
    let started = api
        .build_template(
            &caller,
            BuildTemplate {
                name: args.name.clone(),
                size: args.size.clone(),
                spec: Some(serde_json::to_value(&spec)?),
                ready_cmd: args.ready.clone(),
                ready_timeout_seconds: args.ready_timeout,
                no_cache: args.no_cache,
                ..BuildTemplate::default()
            },
        )
        .await
        .map_err(api_error)?;
    // Its log as it grows, until it is done.
    let mut shown = 0usize;
    let mut stderr = std::io::stderr();
    loop {
        let t = api
            .get_template(&caller, &started.id)
            .await
            .map_err(api_error)?;
        let log = t.log.clone().unwrap_or_default();
        if log.len() >= shown && log.is_char_boundary(shown) {
            let _ = stderr.write_all(&log.as_bytes()[shown..]);
        } else {
            let _ = stderr.write_all(log.as_bytes());
        }
        shown = log.len();
        match t.status.as_str() {
            "building" => tokio::time::sleep(Duration::from_millis(500)).await,
            "ready" => {
                if args.json {
                    println!("{}", serde_json::to_string_pretty(&t)?);
                } else {
                    println!("{}", t.id);
                }
                return Ok(0);
            }
            _ => {
                eprintln!(
                    "template {} failed: {}",
                    args.name,
                    t.error.unwrap_or_default()
                );
                return Ok(1);
            }
        }
    }
}

/// One file or directory packed: its path in the archive, and where it is.
struct Entry {
    name: String,
    path: PathBuf,
}

/// A COPY's sources packed as they are to stand under the directory it
/// returns (Docker's rules: into a destination ending in `/`, taken by
/// several sources or by a directory's contents; else a single file
/// copied to that name).
fn pack(context: &Path, copy: &CopyRequest) -> Result<(Vec<u8>, String)> {
    let root = context
        .canonicalize()
        .with_context(|| format!("the build's context {}", context.display()))?;
    let mut sources = Vec::new();
    for s in &copy.sources {
        if s.contains(['*', '?', '[']) {
            bail!("COPY {s}: wildcards are not supported; name the files or their directory");
        }
        let path = root
            .join(s)
            .canonicalize()
            .with_context(|| format!("COPY {s}: not found in {}", root.display()))?;
        if !path.starts_with(&root) {
            bail!(
                "COPY {s}: it leads outside the build's context {}",
                root.display()
            );
        }
        sources.push((s.clone(), path));
    }
    let into_dir =
        copy.dest.ends_with('/') || sources.len() > 1 || sources.iter().any(|(_, p)| p.is_dir());
    let mut entries = Vec::new();
    let dir = if into_dir {
        for (_, path) in &sources {
            if path.is_dir() {
                walk(path, "", &mut entries)?;
            } else {
                entries.push(Entry {
                    name: file_name(path),
                    path: path.clone(),
                });
            }
        }
        copy.dest_resolved.clone()
    } else {
        let target = Path::new(&copy.dest_resolved);
        entries.push(Entry {
            name: file_name(target),
            path: sources[0].1.clone(),
        });
        target
            .parent()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into())
    };
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    entries.dedup_by(|a, b| a.name == b.name);
    let mut tar = tar::Builder::new(Vec::new());
    for e in &entries {
        let meta = std::fs::symlink_metadata(&e.path)
            .with_context(|| format!("reading {}", e.path.display()))?;
        let mut header = tar::Header::new_gnu();
        header.set_mode(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o7777);
        header.set_mtime(0);
        header.set_uid(0);
        header.set_gid(0);
        if meta.is_dir() {
            header.set_entry_type(tar::EntryType::Directory);
            header.set_size(0);
            tar.append_data(&mut header, &e.name, std::io::empty())?;
        } else if meta.file_type().is_symlink() {
            header.set_entry_type(tar::EntryType::Symlink);
            header.set_size(0);
            let target = std::fs::read_link(&e.path)?;
            tar.append_link(&mut header, &e.name, target)?;
        } else {
            header.set_entry_type(tar::EntryType::Regular);
            header.set_size(meta.len());
            let file = std::fs::File::open(&e.path)
                .with_context(|| format!("reading {}", e.path.display()))?;
            tar.append_data(&mut header, &e.name, file)?;
        }
    }
    let tar = tar.into_inner()?;
    if tar.len() > sandpit_core::MAX_TEMPLATE_FILES_BYTES {
        bail!(
            "COPY {}: {} bytes packed; a copy's files are at most {} bytes",
            copy.sources.join(" "),
            tar.len(),
            sandpit_core::MAX_TEMPLATE_FILES_BYTES
        );
    }
    Ok((tar, dir))
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Every file, link and directory under `dir`, named from `prefix`.
fn walk(dir: &Path, prefix: &str, out: &mut Vec<Entry>) -> Result<()> {
    let mut children: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<std::io::Result<_>>()?;
    children.sort_by_key(|c| c.file_name());
    for child in children {
        let name = format!("{prefix}{}", child.file_name().to_string_lossy());
        let path = child.path();
        let is_dir = child.file_type()?.is_dir();
        out.push(Entry {
            name: name.clone(),
            path: path.clone(),
        });
        if is_dir {
            walk(&path, &format!("{name}/"), out)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(sources: &[&str], dest: &str, resolved: &str) -> CopyRequest {
        CopyRequest {
            sources: sources.iter().map(|s| s.to_string()).collect(),
            dest: dest.into(),
            dest_resolved: resolved.into(),
            user: None,
            mode: None,
        }
    }

    fn names(tar: &[u8]) -> Vec<String> {
        tar::Archive::new(tar)
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn copies_pack_as_docker_lays_them_out_and_the_same_files_hash_the_same() {
        let ctx = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(ctx.path().join("site/css")).unwrap();
        std::fs::write(ctx.path().join("site/index.html"), "<h1>hi</h1>").unwrap();
        std::fs::write(ctx.path().join("site/css/a.css"), "body{}").unwrap();
        std::fs::write(ctx.path().join("app.py"), "print(1)").unwrap();
        // A directory: its contents, under the destination.
        let (tar, dir) = pack(ctx.path(), &request(&["site"], "/srv", "/srv")).unwrap();
        assert_eq!(dir, "/srv");
        assert_eq!(names(&tar), ["css", "css/a.css", "index.html"]);
        // A file to a name.
        let (tar1, dir) =
            pack(ctx.path(), &request(&["app.py"], "main.py", "/app/main.py")).unwrap();
        assert_eq!(
            (dir.as_str(), names(&tar1)),
            ("/app", vec!["main.py".to_string()])
        );
        // A file into a directory; packed again after a touch: the same bytes.
        let (a, dir) = pack(ctx.path(), &request(&["app.py"], "/app/", "/app")).unwrap();
        assert_eq!(
            (dir.as_str(), names(&a)),
            ("/app", vec!["app.py".to_string()])
        );
        let later = std::time::SystemTime::now() + Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(ctx.path().join("app.py"))
            .unwrap()
            .set_modified(later)
            .unwrap();
        let (b, _) = pack(ctx.path(), &request(&["app.py"], "/app/", "/app")).unwrap();
        assert_eq!(a, b, "a touched file packs to the same archive");
        std::fs::write(ctx.path().join("app.py"), "print(2)").unwrap();
        let (c, _) = pack(ctx.path(), &request(&["app.py"], "/app/", "/app")).unwrap();
        assert_ne!(a, c);
        // Nothing outside the context, no wildcards.
        let err = pack(
            ctx.path().join("site").as_path(),
            &request(&["../app.py"], "/x/", "/x"),
        );
        assert!(err.is_err());
        let err = pack(ctx.path(), &request(&["*.py"], "/x/", "/x")).unwrap_err();
        assert!(err.to_string().contains("wildcards"), "{err}");
    }
}
