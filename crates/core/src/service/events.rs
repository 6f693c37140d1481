//! Events and webhooks: the account's log of what happened to its
//! sandboxes, read with a cursor, and the webhooks it is POSTed to.

use crate::api::Events;
use crate::service::Service;

#[async_trait::async_trait]
impl Events for Service {}
