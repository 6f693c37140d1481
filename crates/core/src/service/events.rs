//! Events and webhooks: the account's log of what happened to its
//! sandboxes, read with a cursor, and the webhooks it is POSTed to.
//!
//! The store writes every event in the transaction of the change it
//! records, and with it one delivery row per webhook that wants it (see
//! `sandpit_store`'s `events`). Here: the API over both, and the delivery
//! worker every control plane runs ([`Service::deliver_due`]). Deliveries
//! follow Standard Webhooks: `webhook-id` (the event's id, the same on
//! every retry), `webhook-timestamp` (Unix seconds) and
//! `webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`
//! keyed with the webhook's `whsec_` secret. Each attempt has its own
//! timeout and runs in a task of its own, so a receiver that is down or
//! slow holds nothing but its own deliveries; its address is checked
//! against the operator's deny list after every resolution, and the
//! connection goes to the addresses checked (no second lookup, no
//! redirect, no proxy).

use crate::api::{Caller, Events};
use crate::config::WebhooksConfig;
use crate::error::{CoreError, ErrorType, Result};
use crate::model::*;
use crate::service::Service;
use base64::Engine as _;
use hmac::Mac;
use sandpit_host::ids::rfc3339;
use sandpit_store::{AttemptOutcome, DeliveryRow, DueDelivery, EventRow, WebhookRow};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use time::OffsetDateTime;

/// Who the events of what the service does by itself name: a start's
/// failure, a VM found dead, a server's restart.
pub(crate) const SANDPIT: &str = "sandpit";
/// The end of a sandbox whose time ran out.
pub(crate) const EXPIRY: &str = "the expiry";
/// A pause of a sandbox nobody used for a while.
pub(crate) const IDLE_SWEEP: &str = "the idle sweep";
/// A resume for a visitor of its preview URL.
pub(crate) const PREVIEW: &str = "a preview request";

/// How long after a failed attempt the next comes: about a day in all
/// (23 h 43 min over 11 attempts), then the delivery has failed.
pub const RETRY_AFTER: &[Duration] = &[
    Duration::from_secs(5),
    Duration::from_secs(30),
    Duration::from_secs(120),
    Duration::from_secs(600),
    Duration::from_secs(1800),
    Duration::from_secs(3600),
    Duration::from_secs(2 * 3600),
    Duration::from_secs(4 * 3600),
    Duration::from_secs(8 * 3600),
    Duration::from_secs(8 * 3600),
];

/// How often a worker looks for due deliveries.
pub(crate) const DELIVERY_POLL: Duration = Duration::from_secs(1);

/// Deliveries one process POSTs at once.
pub(crate) const MOST_IN_FLIGHT: usize = 64;

/// What one page of the log holds by default, and at most.
const DEFAULT_EVENTS: u32 = 100;
const MOST_EVENTS: u32 = 500;

/// The delivery time a lease covers: the attempt's timeout and the
/// lookup's, with room to record it. A worker lost mid-attempt lets it
/// lapse, and another tries again.
fn lease_for(config: &WebhooksConfig) -> Duration {
    Duration::from_secs(config.timeout_secs.max(1) * 2 + 30)
}

pub(crate) fn to_event(row: &EventRow) -> Event {
    Event {
        object: "event".into(),
        id: format!("evt_{}", row.id),
        cursor: row.seq.unwrap_or(row.id).to_string(),
        kind: row.kind.clone(),
        sandbox_id: row.sandbox_id.clone(),
        size: row.size.clone(),
        status: row.status.as_str().to_string(),
        actor: row.actor.clone(),
        reason: row.reason.clone(),
        detail: row.detail.clone(),
        at: rfc3339(row.at),
    }
}

fn to_webhook(row: &WebhookRow, with_secret: bool) -> Webhook {
    Webhook {
        object: "webhook".into(),
        id: row.id.clone(),
        url: row.url.clone(),
        events: match row.events.is_empty() {
            true => vec!["*".into()],
            false => row.events.clone(),
        },
        description: row.description.clone(),
        secret: with_secret.then(|| row.secret.clone()),
        created_at: rfc3339(row.created_at),
        pending: row.counts[0],
        delivered: row.counts[1],
        failed: row.counts[2],
    }
}

/// An event id as the API writes it (`evt_12`), as stored.
fn event_number(id: &str) -> Option<i64> {
    id.strip_prefix("evt_")?.parse().ok().filter(|n| *n > 0)
}

/// Whether `ip` may be reached: `None`, or the denied range it is in.
pub fn refused_range(config: &WebhooksConfig, ip: IpAddr) -> Option<String> {
    let ip = ip.to_canonical();
    let within = |list: &[String]| {
        list.iter()
            .find(|range| {
                range
                    .parse::<ipnet::IpNet>()
                    .or_else(|_| range.parse::<IpAddr>().map(ipnet::IpNet::from))
                    .is_ok_and(|net| net.contains(&ip))
            })
            .cloned()
    };
    match within(&config.allow) {
        Some(_) => None,
        None => within(&config.deny),
    }
}

/// Checks `[webhooks] allow` (and the deny list it is given): every entry
/// an IPv4 or IPv6 address or CIDR range.
pub fn check_webhooks_config(config: &WebhooksConfig) -> std::result::Result<(), String> {
    for (name, list) in [("allow", &config.allow), ("deny", &config.deny)] {
        for entry in list {
            if entry.parse::<ipnet::IpNet>().is_err() && entry.parse::<IpAddr>().is_err() {
                return Err(format!(
                    "[webhooks] {name}: {entry:?} is not an IP address or CIDR range"
                ));
            }
        }
    }
    if config.timeout_secs == 0 || config.timeout_secs > 300 {
        return Err(format!(
            "[webhooks] timeout_secs must be between 1 and 300, not {}",
            config.timeout_secs
        ));
    }
    Ok(())
}

/// A webhook's URL, checked: `http` or `https`, a host, no credentials.
fn checked_url(url: &str) -> Result<reqwest::Url> {
    let parsed = reqwest::Url::parse(url.trim())
        .map_err(|e| CoreError::invalid(format!("url {url:?} is not a URL: {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(CoreError::invalid(format!(
            "url {url:?}: a webhook is http:// or https://, not {}://",
            parsed.scheme()
        )));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(CoreError::invalid(format!("url {url:?} names no host")));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(CoreError::invalid(format!(
            "url {url:?} carries credentials; a webhook's deliveries are signed instead"
        )));
    }
    if url.len() > 2048 {
        return Err(CoreError::invalid("url is longer than 2048 bytes"));
    }
    Ok(parsed)
}

/// The addresses `url`'s host resolves to now, every one allowed; or why
/// not (a denied range, no address).
async fn allowed_addresses(
    config: &WebhooksConfig,
    url: &reqwest::Url,
) -> std::result::Result<Vec<SocketAddr>, String> {
    let host = url.host_str().unwrap_or_default();
    let port = url.port_or_known_default().unwrap_or(80);
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let addresses: Vec<SocketAddr> = match bare.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => {
            let lookup = tokio::net::lookup_host((bare, port));
            match tokio::time::timeout(Duration::from_secs(5), lookup).await {
                Ok(Ok(found)) => found.collect(),
                Ok(Err(e)) => return Err(format!("{host} does not resolve: {e}")),
                Err(_) => return Err(format!("resolving {host} took over 5 s")),
            }
        }
    };
    if addresses.is_empty() {
        return Err(format!("{host} resolves to no address"));
    }
    for a in &addresses {
        if let Some(range) = refused_range(config, a.ip()) {
            return Err(format!(
                "{host} resolves to {}, in {range}, which the operator does not allow webhooks \
                 to reach (their [webhooks] allow opens a range)",
                a.ip()
            ));
        }
    }
    Ok(addresses)
}

/// `v1,<base64 HMAC-SHA256("id.timestamp.body")>`, keyed with the secret's
/// bytes (after `whsec_`, base64).
pub fn signature(secret: &str, id: &str, timestamp: i64, body: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    let key = b64
        .decode(secret.strip_prefix("whsec_").unwrap_or(secret))
        .unwrap_or_else(|_| secret.as_bytes().to_vec());
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).expect("HMAC takes any key");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", b64.encode(mac.finalize().into_bytes()))
}

/// What a delivery POSTs: the event, with its type and time on top.
fn delivery_body(event: &Event) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "type": event.kind,
        "timestamp": event.at,
        "data": event,
    }))
    .expect("an event serializes")
}

impl Service {
    /// A webhook of the caller's account, or `not_found`.
    async fn owned_webhook(&self, caller: &Caller, id: &str) -> Result<WebhookRow> {
        self.store
            .webhook_of(&caller.account_id, id)
            .await?
            .ok_or_else(|| CoreError::not_found("webhook", id))
    }

    async fn to_delivery(&self, row: &DeliveryRow) -> Result<WebhookDelivery> {
        let attempts = self
            .store
            .attempts(&row.webhook_id, row.event_id)
            .await?
            .into_iter()
            .map(|a| DeliveryAttempt {
                at: rfc3339(a.at),
                status_code: a.status_code,
                error: a.error,
                duration_ms: a.duration_ms,
            })
            .collect();
        let pending = row.status == sandpit_store::DeliveryStatus::Pending;
        Ok(WebhookDelivery {
            object: "webhook_delivery".into(),
            id: format!("evt_{}", row.event_id),
            webhook_id: row.webhook_id.clone(),
            event_type: row.kind.clone(),
            sandbox_id: row.sandbox_id.clone(),
            status: row.status.as_str().into(),
            next_attempt_at: pending.then(|| rfc3339(row.next_attempt_at)),
            attempts,
            created_at: rfc3339(row.created_at),
            delivered_at: row.delivered_at.map(rfc3339),
        })
    }

    /// Takes the deliveries due now (as many as there is room for in
    /// flight) and POSTs each in a task of its own. Returns how many it
    /// took.
    pub(crate) async fn deliver_due(self: &Arc<Self>) -> usize {
        let room = self.deliveries_in_flight.available_permits();
        if room == 0 {
            return 0;
        }
        let now = OffsetDateTime::now_utc();
        let lease = lease_for(&self.config.webhooks);
        let due = match self
            .store
            .claim_deliveries(now, now + lease, room.min(32) as u32)
            .await
        {
            Ok(due) => due,
            Err(e) => {
                tracing::warn!("taking webhook deliveries: {e}");
                return 0;
            }
        };
        let taken = due.len();
        for delivery in due {
            let Ok(permit) = self.deliveries_in_flight.clone().try_acquire_owned() else {
                break;
            };
            let me = self.clone();
            tokio::spawn(async move {
                me.deliver(delivery).await;
                drop(permit);
            });
        }
        taken
    }

    /// One attempt of one delivery, and its record.
    async fn deliver(&self, d: DueDelivery) {
        let started = std::time::Instant::now();
        let at = OffsetDateTime::now_utc();
        let (status_code, error) = self.post(&d).await;
        let delivered = error.is_none();
        let outcome = match (delivered, RETRY_AFTER.get(d.attempts as usize)) {
            (true, _) => AttemptOutcome::Delivered,
            (false, Some(after)) => AttemptOutcome::RetryAt(
                OffsetDateTime::now_utc() + time::Duration::seconds(after.as_secs() as i64),
            ),
            (false, None) => AttemptOutcome::GaveUp,
        };
        match error.as_deref() {
            None => tracing::debug!(webhook = %d.webhook_id, event = d.event.id, "delivered"),
            Some(e) => tracing::info!(
                webhook = %d.webhook_id, event = d.event.id, attempt = d.attempts + 1,
                "webhook delivery failed: {e}"
            ),
        }
        if let Err(e) = self
            .store
            .record_attempt(
                &d.webhook_id,
                d.event.id,
                &d.lease_until,
                at,
                status_code,
                error.as_deref(),
                started.elapsed().as_millis() as u64,
                &outcome,
            )
            .await
        {
            // The lease lapses and another attempt comes: at least once.
            tracing::warn!(webhook = %d.webhook_id, "recording a webhook attempt: {e}");
        }
    }

    /// POSTs delivery `d`: the receiver's status, and why it does not
    /// count as delivered (`None`: a 2xx).
    async fn post(&self, d: &DueDelivery) -> (Option<u16>, Option<String>) {
        let config = &self.config.webhooks;
        let url = match checked_url(&d.url) {
            Ok(url) => url,
            Err(e) => return (None, Some(e.message)),
        };
        let addresses = match allowed_addresses(config, &url).await {
            Ok(a) => a,
            Err(why) => return (None, Some(format!("refused: {why}"))),
        };
        let host = url.host_str().unwrap_or_default().to_string();
        let client = match reqwest::Client::builder()
            .resolve_to_addrs(&host, &addresses)
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .timeout(Duration::from_secs(config.timeout_secs.max(1)))
            .user_agent(concat!("Sandpit-Webhooks/", env!("CARGO_PKG_VERSION")))
            .build()
        {
            Ok(c) => c,
            Err(e) => return (None, Some(format!("making the HTTP client: {e}"))),
        };
        let event = to_event(&d.event);
        let body = delivery_body(&event);
        let timestamp = OffsetDateTime::now_utc().unix_timestamp();
        let sent = client
            .post(url)
            .header("content-type", "application/json")
            .header("webhook-id", &event.id)
            .header("webhook-timestamp", timestamp.to_string())
            .header(
                "webhook-signature",
                signature(&d.secret, &event.id, timestamp, &body),
            )
            .body(body)
            .send()
            .await;
        match sent {
            Ok(answer) if answer.status().is_success() => (Some(answer.status().as_u16()), None),
            Ok(answer) => (
                Some(answer.status().as_u16()),
                Some(format!("the receiver answered {}", answer.status())),
            ),
            Err(e) if e.is_timeout() => (
                None,
                Some(format!("no answer within {} s", config.timeout_secs)),
            ),
            Err(e) => {
                let mut why = e.to_string();
                let mut source = std::error::Error::source(&e);
                while let Some(s) = source {
                    why = format!("{why}: {s}");
                    source = s.source();
                }
                (None, Some(why))
            }
        }
    }

    /// Forgets events older than the configured retention (a sweep's
    /// step).
    pub(crate) async fn drop_old_events(&self) -> Result<()> {
        let days = i64::from(self.config.webhooks.event_retention_days.max(1));
        let gone = self
            .store
            .purge_events(OffsetDateTime::now_utc() - time::Duration::days(days))
            .await?;
        if gone > 0 {
            tracing::info!("{gone} events older than {days} days dropped");
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Events for Service {
    async fn list_events(&self, caller: &Caller, q: ListEvents) -> Result<List<Event>> {
        let limit = q.limit.unwrap_or(DEFAULT_EVENTS);
        if !(1..=MOST_EVENTS).contains(&limit) {
            return Err(CoreError::invalid(format!(
                "limit must be between 1 and {MOST_EVENTS}, not {limit}"
            )));
        }
        let after = match q.after.as_deref().map(str::trim) {
            None | Some("") => 0,
            Some(c) => c.parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| {
                CoreError::invalid(format!(
                    "after {c:?} is not a cursor (an event's `cursor`, or a list's `next_cursor`)"
                ))
            })?,
        };
        if let Some(id) = &q.sandbox_id {
            self.owned(caller, id).await?;
        }
        let mut rows = self
            .store
            .account_events(
                &caller.account_id,
                after,
                limit + 1,
                q.sandbox_id.as_deref(),
            )
            .await?;
        let has_more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        let data: Vec<Event> = rows.iter().map(to_event).collect();
        let next = data
            .last()
            .map(|e| e.cursor.clone())
            .unwrap_or_else(|| after.to_string());
        Ok(List::new(data, has_more, Some(next)))
    }

    async fn create_webhook(&self, caller: &Caller, req: CreateWebhook) -> Result<Webhook> {
        let url = checked_url(&req.url)?;
        let mut events = Vec::new();
        for kind in &req.events {
            let kind = kind.trim();
            if kind == "*" {
                events.clear();
                break;
            }
            if !EVENT_TYPES.contains(&kind) {
                return Err(CoreError::invalid(format!(
                    "event type {kind:?} is not one of {} (or \"*\")",
                    EVENT_TYPES.join(", ")
                )));
            }
            if !events.iter().any(|e| e == kind) {
                events.push(kind.to_string());
            }
        }
        if req.events.iter().any(|e| e.trim() == "*") {
            events.clear();
        }
        if let Some(d) = &req.description {
            if d.len() > 500 {
                return Err(CoreError::invalid("description is longer than 500 bytes"));
            }
        }
        if let Err(why) = allowed_addresses(&self.config.webhooks, &url).await {
            return Err(CoreError::new(
                ErrorType::InvalidRequest,
                format!("url {:?} is refused: {why}", req.url),
            ));
        }
        let count = self.store.webhooks(&caller.account_id).await?.len();
        let most = self.config.webhooks.max_per_account as usize;
        if count >= most {
            return Err(CoreError::new(
                ErrorType::RateLimited,
                format!("the account has {count} webhooks, its most; delete one first"),
            )
            .lasting());
        }
        let secret = format!(
            "whsec_{}",
            base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 32]>())
        );
        let row = self
            .store
            .create_webhook(
                &sandpit_host::ids::new_id("wh_"),
                &caller.account_id,
                url.as_str(),
                &events,
                req.description.as_deref(),
                &secret,
            )
            .await?;
        Ok(to_webhook(&row, true))
    }

    async fn list_webhooks(&self, caller: &Caller) -> Result<List<Webhook>> {
        let rows = self.store.webhooks(&caller.account_id).await?;
        Ok(List::new(
            rows.iter().map(|w| to_webhook(w, false)).collect(),
            false,
            None,
        ))
    }

    async fn get_webhook(&self, caller: &Caller, id: &str) -> Result<Webhook> {
        Ok(to_webhook(&self.owned_webhook(caller, id).await?, false))
    }

    async fn delete_webhook(&self, caller: &Caller, id: &str) -> Result<Webhook> {
        let before = self
            .store
            .delete_webhook(&caller.account_id, id)
            .await?
            .ok_or_else(|| CoreError::not_found("webhook", id))?;
        Ok(to_webhook(&before, false))
    }

    async fn list_deliveries(
        &self,
        caller: &Caller,
        webhook_id: &str,
        q: ListDeliveries,
    ) -> Result<List<WebhookDelivery>> {
        let webhook = self.owned_webhook(caller, webhook_id).await?;
        let limit = crate::service::checks::page_limit(q.limit)?;
        let after = match q.starting_after.as_deref() {
            None => None,
            Some(c) => Some(
                event_number(c)
                    .ok_or_else(|| crate::service::checks::unknown_cursor("delivery", c))?,
            ),
        };
        let rows = self.store.deliveries(&webhook.id, limit + 1, after).await?;
        let has_more = rows.len() > limit as usize;
        let mut data = Vec::new();
        for row in rows.iter().take(limit as usize) {
            data.push(self.to_delivery(row).await?);
        }
        Ok(List::page(data, has_more, |d| d.id.clone()))
    }

    async fn redeliver(
        &self,
        caller: &Caller,
        webhook_id: &str,
        delivery_id: &str,
    ) -> Result<WebhookDelivery> {
        let webhook = self.owned_webhook(caller, webhook_id).await?;
        let row = match event_number(delivery_id) {
            Some(n) => self.store.redeliver(&webhook.id, n).await?,
            None => None,
        };
        let row = row.ok_or_else(|| CoreError::not_found("delivery", delivery_id))?;
        self.to_delivery(&row).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_standard_webhooks() {
        // Standard Webhooks' own example (its specification's README).
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let id = "msg_p5jXN8AQM9LWM0D4loKWxJek";
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            signature(secret, id, 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn the_deny_list_refuses_private_and_loopback_unless_allowed() {
        let mut config = WebhooksConfig::default();
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "169.254.169.254",
            "192.168.0.1",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(
                refused_range(&config, ip.parse().unwrap()).is_some(),
                "{ip} allowed"
            );
        }
        assert_eq!(
            refused_range(&config, "93.184.216.34".parse().unwrap()),
            None
        );
        config.allow = vec!["10.77.0.0/24".into()];
        assert_eq!(refused_range(&config, "10.77.0.9".parse().unwrap()), None);
        assert!(refused_range(&config, "10.78.0.9".parse().unwrap()).is_some());
        assert!(check_webhooks_config(&config).is_ok());
        config.allow = vec!["10.77.0.0/33".into()];
        assert!(check_webhooks_config(&config).is_err());
    }

    #[test]
    fn a_webhook_url_is_http_with_a_host_and_no_credentials() {
        assert!(checked_url("https://example.com/hook").is_ok());
        assert!(checked_url("http://10.0.0.1:8080/x").is_ok());
        for bad in [
            "ftp://example.com/",
            "https://user:pw@example.com/",
            "not a url",
            "file:///etc/passwd",
        ] {
            assert!(checked_url(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn retries_last_about_a_day() {
        let total: u64 = RETRY_AFTER.iter().map(|d| d.as_secs()).sum();
        assert!((20 * 3600..=25 * 3600).contains(&total), "{total} s");
    }
}
