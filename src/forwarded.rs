//! The client's address behind load balancers (`server.trusted_proxies`).
//!
//! A request whose TCP peer is a trusted proxy takes its client address from
//! `X-Forwarded-For`, read from the right: each proxy appends the address it
//! received the request from, so the rightmost address that is not itself a
//! trusted proxy is the first hop nobody of ours vouches for, the client.
//! Anything left of it was written by the client and is not believed. A
//! request from any other peer keeps the peer's address, whatever headers it
//! sends: otherwise any caller could pick its own rate-limit key.

use http::HeaderMap;
use ipnet::IpNet;
use std::net::IpAddr;
use std::sync::Arc;

/// The networks whose `X-Forwarded-For` is believed. Empty (the default):
/// the TCP peer is the client.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies {
    nets: Vec<IpNet>,
}

impl TrustedProxies {
    /// Parses `server.trusted_proxies` entries: addresses (`10.0.0.7`,
    /// `::1`) or networks in CIDR notation (`10.0.0.0/8`). The error names
    /// the first entry that is neither.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<TrustedProxies, String> {
        let mut nets = Vec::with_capacity(entries.len());
        for entry in entries {
            // `[::1]`, as an IPv6 address is often written, is `::1`.
            let text = entry.as_ref().trim();
            let text = text
                .strip_prefix('[')
                .and_then(|t| t.strip_suffix(']'))
                .unwrap_or(text);
            let net = match text.parse::<IpNet>() {
                Ok(net) => net.trunc(),
                Err(_) => match text.parse::<IpAddr>() {
                    Ok(ip) => IpNet::from(ip),
                    Err(_) => {
                        return Err(format!(
                            "'{text}' is neither an IP address nor a network in CIDR notation (such as 10.0.0.0/8)"
                        ));
                    }
                },
            };
            nets.push(net);
        }
        Ok(TrustedProxies { nets })
    }

    pub fn is_empty(&self) -> bool {
        self.nets.is_empty()
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.nets.iter().any(|net| net.contains(&ip))
    }

    /// The client's address for a request from `peer`, when it differs from
    /// the peer's: `None` keeps the peer (not a trusted proxy, no
    /// `X-Forwarded-For`, or nothing usable in it).
    pub fn client_ip(&self, peer: &str, headers: &HeaderMap) -> Option<Arc<str>> {
        if self.nets.is_empty() {
            return None;
        }
        let peer: IpAddr = peer.parse().ok()?;
        if !self.trusts(peer) {
            return None;
        }
        // Repeated headers form one list, in order (RFC 9110, 5.3); a value
        // that is not visible ASCII makes the list unusable: the peer stands.
        let mut hops: Vec<&str> = Vec::new();
        for value in headers.get_all("x-forwarded-for") {
            let text = value.to_str().ok()?;
            hops.extend(text.split(',').map(str::trim).filter(|h| !h.is_empty()));
        }
        let mut client = None;
        for hop in hops.iter().rev() {
            // Something that is not an address (`unknown`, an obfuscated
            // name) cannot be followed: the last address read stands.
            let Some(ip) = hop_address(hop) else { break };
            client = Some(ip);
            if !self.trusts(ip) {
                break;
            }
        }
        client.map(|ip| canonical(ip).to_string().into())
    }
}

/// One `X-Forwarded-For` entry as an address: `1.2.3.4`, `1.2.3.4:5678`,
/// `2001:db8::1` or `[2001:db8::1]:443`.
fn hop_address(hop: &str) -> Option<IpAddr> {
    if let Ok(ip) = hop.parse() {
        return Some(ip);
    }
    if let Some(rest) = hop.strip_prefix('[') {
        let (ip, after) = rest.split_once(']')?;
        if !(after.is_empty() || after.strip_prefix(':').is_some_and(is_port)) {
            return None;
        }
        return ip.parse().ok();
    }
    let (ip, port) = hop.rsplit_once(':')?;
    if !is_port(port) {
        return None;
    }
    ip.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

fn is_port(text: &str) -> bool {
    text.bytes().all(|b| b.is_ascii_digit()) && text.parse::<u16>().is_ok()
}

/// IPv4 peers of a dual-stack listener arrive as `::ffff:a.b.c.d`; they are
/// matched, and reported, as the IPv4 addresses they are.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for v in values {
            map.append("x-forwarded-for", HeaderValue::from_str(v).unwrap());
        }
        map
    }

    fn proxies(entries: &[&str]) -> TrustedProxies {
        TrustedProxies::parse(entries).unwrap()
    }

    fn client(p: &TrustedProxies, peer: &str, values: &[&str]) -> Option<String> {
        p.client_ip(peer, &headers(values)).map(|ip| ip.to_string())
    }

    #[test]
    fn entries_are_addresses_or_networks() {
        assert!(
            TrustedProxies::parse(&["10.0.0.0/8", "127.0.0.1", "::1", "fd00::/8", "[::1]"]).is_ok()
        );
        let err = TrustedProxies::parse(&["10.0.0.0/8", "lb.internal"]).unwrap_err();
        assert!(err.contains("'lb.internal'"), "{err}");
        assert!(TrustedProxies::parse(&["10.0.0.0/33"]).is_err());
        // Host bits in a network are ignored, as `ip route` does.
        let p = proxies(&["10.1.2.3/8"]);
        assert!(p.trusts("10.200.0.1".parse().unwrap()));
    }

    #[test]
    fn untrusted_peers_keep_their_address() {
        let p = proxies(&["10.0.0.0/8"]);
        assert_eq!(client(&p, "192.0.2.1", &["203.0.113.9"]), None);
        assert_eq!(
            client(&TrustedProxies::default(), "10.0.0.1", &["203.0.113.9"]),
            None
        );
    }

    #[test]
    fn the_rightmost_untrusted_hop_is_the_client() {
        let p = proxies(&["10.0.0.0/8", "127.0.0.1"]);
        // A spoofed first entry is not believed.
        assert_eq!(
            client(&p, "127.0.0.1", &["1.1.1.1, 203.0.113.9, 10.0.0.5"]).as_deref(),
            Some("203.0.113.9")
        );
        // Repeated headers are one list, in order.
        assert_eq!(
            client(&p, "127.0.0.1", &["1.1.1.1", "203.0.113.9", "10.0.0.5"]).as_deref(),
            Some("203.0.113.9")
        );
        // Every hop trusted: the leftmost.
        assert_eq!(
            client(&p, "10.0.0.1", &["10.0.0.9, 10.0.0.5"]).as_deref(),
            Some("10.0.0.9")
        );
        // No header: the peer.
        assert_eq!(client(&p, "10.0.0.1", &[]), None);
    }

    #[test]
    fn ports_brackets_and_mapped_addresses() {
        let p = proxies(&["127.0.0.1"]);
        assert_eq!(
            client(&p, "127.0.0.1", &["198.51.100.4:5123"]).as_deref(),
            Some("198.51.100.4")
        );
        assert_eq!(
            client(&p, "127.0.0.1", &["[2001:db8::1]:443"]).as_deref(),
            Some("2001:db8::1")
        );
        assert_eq!(
            client(&p, "127.0.0.1", &["2001:db8::1"]).as_deref(),
            Some("2001:db8::1")
        );
        assert_eq!(
            client(&p, "::ffff:127.0.0.1", &["::ffff:198.51.100.4"]).as_deref(),
            Some("198.51.100.4")
        );
    }

    #[test]
    fn an_entry_that_is_not_an_address_stops_the_walk() {
        let p = proxies(&["10.0.0.0/8"]);
        assert_eq!(
            client(&p, "10.0.0.1", &["203.0.113.9, unknown, 10.0.0.5"]).as_deref(),
            Some("10.0.0.5")
        );
        assert_eq!(client(&p, "10.0.0.1", &["unknown"]), None);
        assert_eq!(client(&p, "10.0.0.1", &["1.2.3.4:99999"]), None);
    }
}
