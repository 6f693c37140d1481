//! Operator actions on accounts, keys and credit. They need only the store,
//! so `sandpit account|key|credit` work without QEMU or a guest image, on
//! the same data directory a running server uses.

use crate::config::ServiceConfig;
use crate::error::{CoreError, Result};
use crate::model::{micros, usd, Account};
use sandpit_host::ids::rfc3339;
use sandpit_store::{AccountRow, KeyRow, Store};

/// The account object of a stored account.
pub async fn account_object(store: &Store, acct: AccountRow) -> Result<Account> {
    let balance = store.balance(&acct.id).await?;
    let disk_used_bytes = store.account_disk_use(&acct.id).await?;
    Ok(Account {
        object: "account".into(),
        id: acct.id,
        name: acct.name,
        credit_remaining_usd: usd(balance),
        max_concurrent_sandboxes: acct.max_concurrent,
        created_at: rfc3339(acct.created_at),
        disk_used_bytes,
    })
}

fn check_usd(amount: f64) -> Result<()> {
    if !amount.is_finite() || !(0.0..=1e9).contains(&amount) {
        return Err(CoreError::invalid(
            "an amount of credit is a non-negative number of USD",
        ));
    }
    Ok(())
}

/// Create an account with `credit_usd` of credit.
pub async fn create_account(
    store: &Store,
    config: &ServiceConfig,
    name: &str,
    credit_usd: f64,
) -> Result<Account> {
    let name = name.trim();
    if name.is_empty() || name.len() > 100 {
        return Err(CoreError::invalid("account names are 1 to 100 characters"));
    }
    check_usd(credit_usd)?;
    let row = store
        .create_account(name, config.default_max_concurrent_sandboxes)
        .await
        .map_err(|e| match e {
            sandpit_store::StoreError::Conflict(_) => {
                CoreError::conflict(format!("an account named {name:?} already exists"))
            }
            other => other.into(),
        })?;
    if credit_usd > 0.0 {
        store
            .add_credit(&row.id, micros(credit_usd), Some("initial credit"))
            .await?;
    }
    account_object(store, row).await
}

/// The account named `name`.
pub async fn account_by_name(store: &Store, name: &str) -> Result<AccountRow> {
    store
        .account_by_name(name)
        .await?
        .ok_or_else(|| CoreError::not_found("account", name))
}

/// Add credit to the account named `name`.
pub async fn add_credit(store: &Store, name: &str, usd_amount: f64) -> Result<Account> {
    check_usd(usd_amount)?;
    if usd_amount == 0.0 {
        return Err(CoreError::invalid("the amount must be positive"));
    }
    let acct = account_by_name(store, name).await?;
    store
        .add_credit(&acct.id, micros(usd_amount), Some("added by an operator"))
        .await?;
    account_object(store, acct).await
}

/// A new API key for the account named `name`; the key is returned once.
pub async fn create_key(store: &Store, name: &str) -> Result<(String, KeyRow)> {
    let acct = account_by_name(store, name).await?;
    Ok(store.create_key(&acct.id).await?)
}

/// Every account with its balance.
pub async fn list_accounts(store: &Store) -> Result<Vec<Account>> {
    let mut out = Vec::new();
    for a in store.list_accounts().await? {
        out.push(account_object(store, a).await?);
    }
    Ok(out)
}
