//! The front door (K13): no single client can hold every connection, and
//! `/health` answers even when the server holds all it may.
//!
//! * **Per client.** At most [`ServerConfig::max_connections_per_client`]
//!   connections per client address; one more is answered 429
//!   (`too_many_connections`, OpenAI's error shape) and closed.
//! * **In all.** At most [`ServerConfig::max_connections`]; beyond it a
//!   connection is answered 503 (`server_busy`) and closed — except
//!   `GET /health`, which is answered as usual. These answers run in an
//!   *overflow lane* of [`OVERFLOW_MAX`] connections, each with
//!   [`OVERFLOW_TIMEOUT`] to send its request head; beyond that lane a
//!   connection is closed at once. Nothing in the lane reaches the backend.
//! * **Silence.** A connection must send its first request byte within
//!   [`ServerConfig::first_byte_timeout`] (a connection that never speaks
//!   holds a slot that long at most); hyper's header timeout bounds the
//!   rest of the head and the idle time between keep-alive requests.
//!
//! [`ServerConfig::max_connections_per_client`]: crate::ServerConfig::max_connections_per_client
//! [`ServerConfig::max_connections`]: crate::ServerConfig::max_connections
//! [`ServerConfig::first_byte_timeout`]: crate::ServerConfig::first_byte_timeout

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Connections answered at once in the overflow lane.
pub const OVERFLOW_MAX: usize = 64;
/// Time an overflow connection has to send its request head.
pub const OVERFLOW_TIMEOUT: Duration = Duration::from_secs(2);

/// Connections held per client address.
#[derive(Debug)]
pub(crate) struct Door {
    per_client: Mutex<HashMap<IpAddr, usize>>,
    max_per_client: usize,
}

/// A client's hold on one of its connections; released on drop.
pub(crate) struct ClientSlot {
    door: Arc<Door>,
    ip: IpAddr,
}

impl Door {
    pub fn new(max_per_client: usize) -> Arc<Door> {
        Arc::new(Door {
            per_client: Mutex::new(HashMap::new()),
            max_per_client: max_per_client.max(1),
        })
    }

    /// A slot for one more connection of `ip`, unless it holds its limit.
    pub fn enter(self: &Arc<Door>, ip: IpAddr) -> Option<ClientSlot> {
        let mut m = self.per_client.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(ip).or_insert(0);
        if *n >= self.max_per_client {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            door: self.clone(),
            ip,
        })
    }

    /// Connections `ip` holds now.
    #[cfg(test)]
    pub fn held(&self, ip: IpAddr) -> usize {
        let m = self.per_client.lock().unwrap_or_else(|e| e.into_inner());
        m.get(&ip).copied().unwrap_or(0)
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut m = self
            .door
            .per_client
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                // The map holds only clients with a connection (bounded by
                // `max_connections`).
                m.remove(&self.ip);
            }
        }
    }
}

/// Why a connection is in the overflow lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Overflow {
    /// Its address holds its limit of connections.
    Client { limit: usize },
    /// The server holds its limit of connections.
    Server { limit: usize },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_holds_at_most_its_limit_and_slots_come_back() {
        let d = Door::new(2);
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.3".parse().unwrap();
        let s1 = d.enter(a).unwrap();
        let _s2 = d.enter(a).unwrap();
        assert!(d.enter(a).is_none());
        // Another address is not affected.
        let _t = d.enter(b).unwrap();
        drop(s1);
        assert_eq!(d.held(a), 1);
        assert!(d.enter(a).is_some());
    }
}
