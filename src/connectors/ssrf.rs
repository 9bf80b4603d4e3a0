//! The SSRF guard of `http_call`: which addresses an outbound call may reach
//! when `security.allow_private_networks` is false.
//!
//! A hostname is checked where it becomes addresses (a DNS resolver that
//! filters them), so a name that resolves to 127.0.0.1 is caught and no
//! re-resolution between check and connect can slip through. Literal IP
//! hosts never reach a resolver, so they are checked on the URL, for the
//! first request and on every redirect hop.

use reqwest::Url;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// An outbound call the guard refused, with the reason (host and address,
/// never credentials).
#[derive(Debug, Clone)]
pub struct Refused {
    message: String,
    /// The host the message names (as in the URL, without IPv6 brackets)
    /// and why its address is refused; `None` for a refused scheme.
    host: Option<(String, &'static str)>,
}

impl Refused {
    fn other(message: String) -> Self {
        Refused {
            message,
            host: None,
        }
    }

    /// The message, unless it names `hidden` (a host taken from the
    /// environment through `env://`, which never appears anywhere): then
    /// the reason alone.
    pub fn hiding(&self, hidden: Option<&str>) -> String {
        match (&self.host, hidden) {
            (Some((host, why)), Some(hidden)) if host.eq_ignore_ascii_case(hidden) => format!(
                "refused to call the connector's host (taken from the environment): {why} \
                 addresses are blocked (security.allow_private_networks is false)"
            ),
            _ => self.message.clone(),
        }
    }
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Refused {}

/// Why `ip` may not be called, or `None` when it is a public address.
pub fn refusal(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => v4_refusal(v4),
        IpAddr::V6(v6) => v6_refusal(v6),
    }
}

fn v4_refusal(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(if ip.is_loopback() {
        "loopback"
    } else if ip.is_private() {
        "private (RFC 1918)"
    } else if ip.is_link_local() {
        "link-local"
    } else if a == 0 {
        // 0.0.0.0/8 "this network": 0.0.0.0 reaches the local host on Linux.
        "unspecified"
    } else if a == 100 && (b & 0xc0) == 64 {
        "shared address space (CGNAT, 100.64.0.0/10)"
    } else if a == 198 && (b & 0xfe) == 18 {
        // Not routed on the Internet; in practice inside some networks.
        "benchmarking (198.18.0.0/15)"
    } else if (a, b, c) == (192, 0, 0) {
        "IETF protocol assignments (192.0.0.0/24)"
    } else if matches!((a, b, c), (192, 0, 2) | (198, 51, 100) | (203, 0, 113)) {
        "documentation (TEST-NET)"
    } else if ip.is_multicast() {
        "multicast"
    } else if ip.is_broadcast() || a >= 240 {
        "reserved"
    } else {
        return None;
    })
}

fn v6_refusal(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if ip.is_loopback() {
        return Some("loopback");
    }
    if ip.is_unspecified() {
        return Some("unspecified");
    }
    // IPv4 embedded in IPv6 reaches the IPv4 address: IPv4-mapped
    // (::ffff:a.b.c.d), the deprecated IPv4-compatible form (::a.b.c.d) and
    // the NAT64 well-known prefix (64:ff9b::/96) are judged by that address.
    if let Some(v4) = ip.to_ipv4() {
        return v4_refusal(v4);
    }
    // So are the IPv4-translated form (::ffff:0:a.b.c.d, RFC 2765) and
    // 6to4 (2002:AABB:CCDD::/48, the IPv4 address in segments 1 and 2).
    let embedded = |hi: u16, lo: u16| Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] || s[..6] == [0, 0, 0, 0, 0xffff, 0] {
        return v4_refusal(embedded(s[6], s[7]));
    }
    if s[0] == 0x2002
        && let Some(why) = v4_refusal(embedded(s[1], s[2]))
    {
        return Some(why);
    }
    Some(if (s[0] & 0xffc0) == 0xfe80 {
        "link-local"
    } else if (s[0] & 0xfe00) == 0xfc00 {
        "unique-local"
    } else if (s[0] & 0xffc0) == 0xfec0 {
        "site-local"
    } else if ip.is_multicast() {
        "multicast"
    } else if s[0] == 0x2001 && s[1] == 0x0db8 {
        "documentation (2001:db8::/32)"
    } else {
        return None;
    })
}

/// Checks a URL before it is requested (the first request and every redirect
/// hop): http(s) only, and a literal IP host must be public. Hostnames are
/// left to [`GuardedResolver`].
pub fn check_url(url: &Url) -> Result<(), Refused> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(Refused::other(format!(
            "refused to call a {}: URL (only http and https are allowed)",
            url.scheme()
        )));
    }
    let Some(host) = url.host_str() else {
        return Err(Refused::other(
            "refused to call a URL without a host".into(),
        ));
    };
    // The URL parser has already normalized IPv4 spellings (2130706433,
    // 0x7f.1) to dotted form; IPv6 literals keep their brackets.
    let literal = host.trim_start_matches('[').trim_end_matches(']');
    let Ok(ip) = literal.parse::<IpAddr>() else {
        return Ok(());
    };
    match refusal(ip) {
        None => Ok(()),
        Some(why) => {
            let mut refused = refused_ip(&ip.to_string(), ip, why);
            // As the URL spells it, which is what `hiding` compares.
            refused.host = Some((literal.to_owned(), why));
            Err(refused)
        }
    }
}

fn refused_ip(host: &str, ip: IpAddr, why: &'static str) -> Refused {
    let target = if host == ip.to_string() {
        format!("address {ip}")
    } else {
        format!("host '{host}' (resolves to {ip})")
    };
    Refused {
        message: format!(
            "refused to call {target}: {why} addresses are blocked (security.allow_private_networks is false)"
        ),
        host: Some((host.to_owned(), why)),
    }
}

/// A DNS resolver that drops refused addresses; a host with nothing else
/// left fails to resolve with a [`Refused`] error naming the reason.
#[derive(Debug, Clone, Copy, Default)]
pub struct GuardedResolver;

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let resolved: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let mut first_refused = None;
            let allowed: Vec<SocketAddr> = resolved
                .into_iter()
                .filter(|a| match refusal(a.ip()) {
                    None => true,
                    Some(why) => {
                        first_refused.get_or_insert((a.ip(), why));
                        false
                    }
                })
                .collect();
            if allowed.is_empty() {
                return Err(match first_refused {
                    Some((ip, why)) => Box::new(refused_ip(&host, ip, why)) as _,
                    None => format!("host '{host}' resolved to no address").into(),
                });
            }
            Ok(Box::new(allowed.into_iter()) as Addrs)
        })
    }
}

/// The redirect policy of an HTTP connector: at most 10 hops; under the
/// guard (`guarded`) each hop's address is checked; with `keep_origin` (a
/// connector that holds credentials) a hop to another origin is refused.
/// reqwest drops `Authorization` and cookies on such a hop, but not the
/// connector's other credential headers (`X-Api-Key`, a custom token), so
/// following it would hand them to whatever host the upstream names.
pub fn redirect_policy(guarded: bool, keep_origin: bool) -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() >= 10 {
            return attempt.error("too many redirects (more than 10)");
        }
        if keep_origin
            && let Some(first) = attempt.previous().first()
            && first.origin() != attempt.url().origin()
            && !upgrade(first, attempt.url())
        {
            let to = attempt.url().origin().ascii_serialization();
            return attempt.error(format!(
                "redirected to another origin ({to}); the connector's credentials are not sent there"
            ));
        }
        if guarded && let Err(refused) = check_url(attempt.url()) {
            return attempt.error(refused);
        }
        attempt.follow()
    })
}

/// Whether `to` is `from` moved from http to https on the same host (a
/// 301 to TLS keeps the credentials with the same server).
fn upgrade(from: &reqwest::Url, to: &reqwest::Url) -> bool {
    from.scheme() == "http"
        && to.scheme() == "https"
        && from.host_str() == to.host_str()
        && from.port().is_none()
        && to.port().is_none()
}

/// The [`Refused`] error somewhere in `e`'s source chain, if the guard is
/// why a request failed.
pub fn find_refused<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a Refused> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<Refused>() {
            return Some(r);
        }
        cur = err.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn why(s: &str) -> Option<&'static str> {
        refusal(s.parse().unwrap())
    }

    #[test]
    fn an_upgrade_to_tls_on_the_same_host_keeps_the_origin() {
        let u = |s: &str| Url::parse(s).unwrap();
        assert!(upgrade(
            &u("http://api.example.com/a"),
            &u("https://api.example.com/a")
        ));
        assert!(!upgrade(
            &u("http://api.example.com/a"),
            &u("https://evil.example.com/a")
        ));
        assert!(!upgrade(
            &u("https://api.example.com/"),
            &u("http://api.example.com/")
        ));
        assert!(!upgrade(
            &u("http://api.example.com:8080/"),
            &u("https://api.example.com/")
        ));
    }

    #[test]
    fn private_and_special_addresses_are_refused() {
        for (ip, reason) in [
            ("127.0.0.1", "loopback"),
            ("127.255.0.9", "loopback"),
            ("10.1.2.3", "private (RFC 1918)"),
            ("172.16.0.1", "private (RFC 1918)"),
            ("172.31.255.255", "private (RFC 1918)"),
            ("192.168.1.1", "private (RFC 1918)"),
            ("169.254.169.254", "link-local"),
            ("0.0.0.0", "unspecified"),
            ("0.1.2.3", "unspecified"),
            ("100.64.0.1", "shared address space (CGNAT, 100.64.0.0/10)"),
            ("198.18.0.1", "benchmarking (198.18.0.0/15)"),
            ("198.19.255.1", "benchmarking (198.18.0.0/15)"),
            ("192.0.0.1", "IETF protocol assignments (192.0.0.0/24)"),
            ("192.0.2.2", "documentation (TEST-NET)"),
            ("203.0.113.9", "documentation (TEST-NET)"),
            (
                "100.127.255.254",
                "shared address space (CGNAT, 100.64.0.0/10)",
            ),
            ("224.0.0.1", "multicast"),
            ("255.255.255.255", "reserved"),
            ("::1", "loopback"),
            ("::", "unspecified"),
            ("fe80::1", "link-local"),
            ("febf::1", "link-local"),
            ("fc00::1", "unique-local"),
            ("fd12:3456::1", "unique-local"),
            ("ff02::1", "multicast"),
            ("2001:db8::1", "documentation (2001:db8::/32)"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:10.0.0.1", "private (RFC 1918)"),
            ("::ffff:169.254.169.254", "link-local"),
            (
                "::ffff:100.64.0.1",
                "shared address space (CGNAT, 100.64.0.0/10)",
            ),
            ("::ffff:0.0.0.0", "unspecified"),
            ("::ffff:224.0.0.1", "multicast"),
            ("::127.0.0.1", "loopback"),
            ("64:ff9b::7f00:1", "loopback"),
            ("64:ff9b::a00:1", "private (RFC 1918)"),
            // IPv4-translated and 6to4 (session 17's audit reached the
            // network with these).
            ("::ffff:0:127.0.0.1", "loopback"),
            ("::ffff:0:a00:1", "private (RFC 1918)"),
            ("2002:7f00:1::", "loopback"),
            ("2002:a9fe:a9fe::1", "link-local"),
        ] {
            assert_eq!(why(ip), Some(reason), "{ip}");
        }
    }

    #[test]
    fn public_addresses_pass() {
        for ip in [
            "8.8.8.8",
            "1.1.1.1",
            "172.32.0.1",
            "100.128.0.1",
            "100.63.255.255",
            "169.255.0.1",
            "2001:4860:4860::8888",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "::ffff:0:808:808",
            "2002:808:808::1",
        ] {
            assert_eq!(why(ip), None, "{ip}");
        }
    }

    #[test]
    fn urls_with_literal_private_hosts_are_refused() {
        let check = |u: &str| check_url(&Url::parse(u).unwrap());
        assert!(check("http://example.com/x").is_ok());
        assert!(check("https://8.8.8.8/").is_ok());
        let e = check("http://127.0.0.1:8080/x").unwrap_err();
        assert!(
            e.message.contains("127.0.0.1") && e.message.contains("loopback"),
            "{e}"
        );
        // Alternative spellings are normalized by the URL parser.
        assert!(check("http://2130706433/").is_err());
        assert!(check("http://0x7f.1/").is_err());
        assert!(check("http://[::ffff:7f00:1]/").is_err());
        assert!(check("http://[fd00::1]/").is_err());
        assert!(check("file:///etc/passwd").is_err());
    }

    #[tokio::test]
    async fn the_resolver_refuses_names_of_loopback_addresses() {
        let name: Name = "localhost".parse().unwrap();
        let e = match GuardedResolver.resolve(name).await {
            Ok(_) => panic!("localhost must be refused"),
            Err(e) => e,
        };
        let r = find_refused(&*e).expect("a Refused error");
        assert!(r.message.contains("host 'localhost'"), "{r}");
        assert!(r.message.contains("loopback"), "{r}");
    }
}
