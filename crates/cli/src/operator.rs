//! The operator's commands on the control plane's store: `sandpit account`,
//! `key`, `credit` and `invite`. They act on the database directly (the
//! data directory's SQLite file, or `--database`), with or without a
//! server running.

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use sandpit_core::admin;
use sandpit_server::serve::open_store;
use sandpit_server::settings::Settings;

#[derive(Subcommand)]
pub enum AccountCommand {
    /// Create an account
    Create {
        name: String,
        /// Initial credit in USD
        #[arg(long, default_value_t = 0.0)]
        credit: f64,
        /// An operator's account: its dashboard shows every account and
        /// can add credit
        #[arg(long)]
        admin: bool,
        /// Most sandboxes it may have live at once (default: the
        /// configuration's `max_concurrent_sandboxes`)
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        max_sandboxes: Option<u32>,
    },
    /// List accounts with their credit
    List,
    /// Make an existing account an operator's (or, with --off, no longer)
    Admin {
        name: String,
        #[arg(long)]
        off: bool,
    },
}

#[derive(Subcommand)]
pub enum KeyCommand {
    /// Create an API key; prints the key alone on stdout (it is shown only once)
    Create {
        #[arg(long)]
        account: String,
    },
    /// List keys (prefixes, never the keys)
    List {
        #[arg(long)]
        account: Option<String>,
    },
    /// Revoke a key by id or prefix
    Revoke { key: String },
}

#[derive(Subcommand)]
pub enum CreditCommand {
    /// Add credit (USD) to an account
    Add {
        #[arg(long)]
        account: String,
        usd: f64,
    },
}

#[derive(Subcommand)]
pub enum InviteCommand {
    /// Make an invitation code; prints the code alone on stdout (it is
    /// shown only once)
    Create {
        /// How many accounts it may make
        #[arg(long, default_value_t = 1)]
        uses: u32,
        /// How long it is good for, e.g. 7d, 12h
        #[arg(long, default_value = "7d")]
        valid: humantime::Duration,
    },
}

pub async fn account(settings: &Settings, cmd: AccountCommand) -> Result<i32> {
    let store = open_store(settings).await?;
    match cmd {
        AccountCommand::Create {
            name,
            credit,
            admin: operator,
            max_sandboxes,
        } => {
            let mut service = settings.service.clone();
            if let Some(most) = max_sandboxes {
                service.default_max_concurrent_sandboxes = most;
            }
            let a = admin::create_account(&store, &service, &name, credit).await?;
            if operator {
                store.set_admin(&a.id, true).await?;
            }
            println!("{}", serde_json::to_string_pretty(&a)?);
        }
        AccountCommand::Admin { name, off } => {
            let a = admin::account_by_name(&store, &name).await?;
            store.set_admin(&a.id, !off).await?;
            println!(
                "{name} is {} operator's account",
                if off { "no longer an" } else { "an" }
            );
        }
        AccountCommand::List => {
            println!(
                "{:<30} {:<20} {:>12} {:>6}",
                "ID", "NAME", "CREDIT USD", "MAX"
            );
            for a in admin::list_accounts(&store).await? {
                println!(
                    "{:<30} {:<20} {:>12.6} {:>6}",
                    a.id, a.name, a.credit_remaining_usd, a.max_concurrent_sandboxes
                );
            }
        }
    }
    Ok(0)
}

pub async fn key(settings: &Settings, cmd: KeyCommand) -> Result<i32> {
    let store = open_store(settings).await?;
    match cmd {
        KeyCommand::Create { account } => {
            let (key, row) = admin::create_key(&store, &account).await?;
            eprintln!(
                "key {} ({}) for account {account}; it is shown only now",
                row.id, row.prefix
            );
            if let Some(e2b) = sandpit_store::e2b_spelling(&key) {
                eprintln!("its spelling for E2B's SDKs (E2B_API_KEY): {e2b}");
            }
            println!("{key}");
        }
        KeyCommand::List { account } => {
            let acct = match account {
                Some(name) => Some(admin::account_by_name(&store, &name).await?.id),
                None => None,
            };
            println!(
                "{:<30} {:<14} {:<30} {:<22} REVOKED",
                "ID", "PREFIX", "ACCOUNT", "LAST USED"
            );
            for k in store.list_keys(acct.as_deref()).await? {
                println!(
                    "{:<30} {:<14} {:<30} {:<22} {}",
                    k.id,
                    k.prefix,
                    k.account_id,
                    k.last_used_at
                        .map(sandpit_host::ids::rfc3339)
                        .unwrap_or_else(|| "-".into()),
                    k.revoked_at
                        .map(sandpit_host::ids::rfc3339)
                        .unwrap_or_else(|| "-".into())
                );
            }
        }
        KeyCommand::Revoke { key } => {
            if store.revoke_key(&key).await? {
                eprintln!("revoked {key}");
            } else {
                bail!("no active key matches {key:?}");
            }
        }
    }
    Ok(0)
}

pub async fn credit(settings: &Settings, cmd: CreditCommand) -> Result<i32> {
    let store = open_store(settings).await?;
    let CreditCommand::Add { account, usd } = cmd;
    let a = admin::add_credit(&store, &account, usd).await?;
    println!("{}", serde_json::to_string_pretty(&a)?);
    Ok(0)
}

pub async fn invite(settings: &Settings, cmd: InviteCommand) -> Result<i32> {
    let store = open_store(settings).await?;
    let InviteCommand::Create { uses, valid } = cmd;
    if uses == 0 {
        bail!("an invitation makes at least one account (--uses 1 or more)");
    }
    let ttl = time::Duration::try_from(*valid.as_ref()).context("--valid is too long")?;
    let (code, expires) = store.create_invite(uses, ttl).await?;
    if settings.signup.mode != sandpit_web::SignupMode::Invite {
        eprintln!(
            "note: sign-up is not invite-only in this configuration ([signup] mode = \"invite\" makes it so)"
        );
    }
    eprintln!(
        "an invitation for {uses} account(s), good until {}",
        sandpit_host::ids::rfc3339(expires)
    );
    println!("{code}");
    Ok(0)
}
