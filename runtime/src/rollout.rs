//! Rollout buckets: a stable hash of the request's identity into 0..100.
//!
//! The bucket is the first present of: header `x-rollout-key`, header
//! `authorization`, a caller-supplied `x-request-id`, the client IP. The hash
//! (64-bit FNV-1a) is fixed, not seeded per process, so every replica routes
//! one caller the same way.

/// The bucket (0..100) for an identity string.
pub fn bucket(key: &str) -> u8 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.as_bytes() {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    (hash % 100) as u8
}

/// Picks the identity per the decisions: `headers` must have lowercase names;
/// `caller_request_id` is the request id only when the caller supplied it.
pub fn bucket_for(
    headers: &[(&str, &str)],
    caller_request_id: Option<&str>,
    client_ip: Option<&str>,
) -> Option<u8> {
    let header = |name: &str| headers.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
    header("x-rollout-key")
        .or_else(|| header("authorization"))
        .or(caller_request_id)
        .or(client_ip)
        .map(bucket)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_and_spread() {
        assert_eq!(bucket("alice"), bucket("alice"));
        let mut seen = [0u32; 100];
        for i in 0..10_000 {
            seen[bucket(&format!("caller-{i}")) as usize] += 1;
        }
        // Every bucket is used and none gets more than twice its share.
        assert!(seen.iter().all(|&n| n > 0 && n < 200), "{seen:?}");
    }

    #[test]
    fn identity_order() {
        let h = [("authorization", "Bearer x"), ("x-rollout-key", "k")];
        assert_eq!(bucket_for(&h, Some("r"), Some("ip")), Some(bucket("k")));
        assert_eq!(
            bucket_for(&h[..1], Some("r"), Some("ip")),
            Some(bucket("Bearer x"))
        );
        assert_eq!(bucket_for(&[], Some("r"), Some("ip")), Some(bucket("r")));
        assert_eq!(bucket_for(&[], None, Some("ip")), Some(bucket("ip")));
        assert_eq!(bucket_for(&[], None, None), None);
    }
}
