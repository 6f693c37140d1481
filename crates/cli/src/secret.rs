//! `sandpit secret`: an account's secrets on a server (--url,
//! SANDPIT_API_KEY): store one (its value read from stdin, so it is in no
//! shell history and no process list), list them (never with values: the
//! server does not give them back), delete one.

use crate::sandbox::{api_error, server, ServerArgs};
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use sandpit_core::api::prelude::*;
use sandpit_core::PutSecret;
use std::io::Read;

#[derive(Subcommand)]
pub enum SecretCommand {
    /// Store secret NAME (an environment variable's name), its value read
    /// from stdin; a sandbox created with it gets a placeholder, which the
    /// host replaces with the value in HTTPS requests to its hosts only
    Set {
        name: String,
        /// A host it may be sent to: api.example.com, or *.example.com for
        /// any name under it (again for more)
        #[arg(long = "host", required = true, value_name = "HOST")]
        hosts: Vec<String>,
        /// The request header it goes in [default: Authorization]
        #[arg(long)]
        header: Option<String>,
        /// The header's value, {value} standing for the secret [default:
        /// 'Bearer {value}'; '{value}' for a header such as x-api-key]
        #[arg(long)]
        format: Option<String>,
        #[command(flatten)]
        server: ServerArgs,
        /// Print the stored secret (without its value) as JSON
        #[arg(long)]
        json: bool,
    },
    /// List the account's secrets: name, hosts, header and format
    #[command(visible_alias = "list")]
    Ls {
        #[command(flatten)]
        server: ServerArgs,
        #[arg(long)]
        json: bool,
    },
    /// Delete secrets (by name)
    #[command(visible_alias = "delete")]
    Rm {
        #[arg(required = true)]
        names: Vec<String>,
        #[command(flatten)]
        server: ServerArgs,
    },
}

pub async fn run(cmd: SecretCommand) -> Result<i32> {
    match cmd {
        SecretCommand::Set {
            name,
            hosts,
            header,
            format,
            server: s,
            json,
        } => {
            let value = value_from(std::io::stdin().lock())?;
            let (api, caller) = server(&s).await?;
            let req = PutSecret {
                value,
                hosts,
                header,
                format,
            };
            let secret = api
                .put_secret(&caller, &name, req)
                .await
                .map_err(api_error)?;
            match json {
                true => println!("{}", serde_json::to_string_pretty(&secret)?),
                false => println!("{}", secret.name),
            }
            Ok(0)
        }
        SecretCommand::Ls { server: s, json } => {
            let (api, caller) = server(&s).await?;
            let list = api.list_secrets(&caller).await.map_err(api_error)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                for secret in &list.data {
                    println!(
                        "{}\t{}\t{}: {}\t{}",
                        secret.name,
                        secret.hosts.join(","),
                        secret.header,
                        secret.format,
                        secret.updated_at
                    );
                }
            }
            Ok(0)
        }
        SecretCommand::Rm { names, server: s } => {
            let (api, caller) = server(&s).await?;
            for name in names {
                api.delete_secret(&caller, &name).await.map_err(api_error)?;
                println!("{name}");
            }
            Ok(0)
        }
    }
}

/// A secret's value as `input` gives it: one trailing newline (what
/// `echo` and a file's last line add) taken off; an empty one refused.
fn value_from(mut input: impl Read) -> Result<String> {
    let mut value = String::new();
    input
        .read_to_string(&mut value)
        .context("reading the secret's value from stdin")?;
    if value.ends_with('\n') {
        value.pop();
        if value.ends_with('\r') {
            value.pop();
        }
    }
    if value.is_empty() {
        bail!("no value on stdin: pipe the secret in (`printf %s \"$KEY\" | sandpit secret set NAME --host HOST`)");
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::value_from;

    #[test]
    fn one_trailing_newline_is_taken_off_and_an_empty_value_refused() {
        assert_eq!(value_from(&b"sk-1\n"[..]).unwrap(), "sk-1");
        assert_eq!(value_from(&b"sk-1\r\n"[..]).unwrap(), "sk-1");
        assert_eq!(value_from(&b"sk-1"[..]).unwrap(), "sk-1");
        assert_eq!(value_from(&b"sk-1\n\n"[..]).unwrap(), "sk-1\n");
        assert!(value_from(&b"\n"[..]).is_err());
        assert!(value_from(&b""[..]).is_err());
    }
}
