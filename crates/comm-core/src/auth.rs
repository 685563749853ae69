//! The shared secret of a job and the challenge-response that proves it on every connection of
//! the `process` backend's mesh (and of the rendezvous store).
//!
//! The launcher puts a fresh random token in every rank's environment ([`TOKEN_ENV`]; `dtrun`
//! does, a new one per start). A connection is accepted only after both ends proved they hold
//! it: each sends a fresh 16-byte nonce, and each answers with HMAC-SHA256(token, role | both
//! nonces | what the connection is for), the roles differing so neither proof can be replayed
//! as the other. The token itself never travels. What this does not give: encryption (the
//! data is in clear on the wire) and integrity of the frames after the handshake; see
//! docs/ARCHITECTURE.md.

use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::sync::{Arc, Once};
use std::time::Instant;

use sha2::{Digest, Sha256};

/// The environment variable holding the job's token.
pub const TOKEN_ENV: &str = "CDT_JOB_TOKEN";

/// The environment variable that, set to `1`, lets a rendezvous store without a job token
/// serve peers on other hosts (`dtrun --insecure` sets it); see [`crate::store::StoreConfig`].
pub const INSECURE_ENV: &str = "CDT_INSECURE";

/// Bytes of a nonce.
pub const NONCE: usize = 16;
/// Bytes of a proof (an HMAC-SHA256).
pub const PROOF: usize = 32;

/// A job's shared secret (never printed).
#[derive(Clone)]
pub struct Token(Arc<Vec<u8>>);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// A token of these bytes.
    pub fn new(bytes: &[u8]) -> Token {
        Token(Arc::new(bytes.to_vec()))
    }

    /// The token of [`TOKEN_ENV`]; without one, the empty token (connections still run the
    /// handshake, but anyone can compute its proofs), with a warning once per process.
    pub fn from_env() -> Token {
        match std::env::var_os(TOKEN_ENV) {
            Some(t) if !t.is_empty() => Token::new(t.as_encoded_bytes()),
            _ => {
                static WARNED: Once = Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        "{TOKEN_ENV} is not set: connections are not authenticated (anything \
                         that reaches the ports can join); dtrun sets it, other launchers \
                         should export a random value to every rank"
                    );
                });
                Token::new(&[])
            }
        }
    }

    /// The token of [`TOKEN_ENV`], or `None` when it is not set (no warning).
    pub fn from_env_quiet() -> Option<Token> {
        match std::env::var_os(TOKEN_ENV) {
            Some(t) if !t.is_empty() => Some(Token::new(t.as_encoded_bytes())),
            _ => None,
        }
    }

    /// The proof of `role` over `parts` (each length-prefixed, so no two inputs collide).
    pub fn prove(&self, role: &str, parts: &[&[u8]]) -> [u8; PROOF] {
        let mut msg = Vec::new();
        for p in std::iter::once(role.as_bytes()).chain(parts.iter().copied()) {
            msg.extend_from_slice(&(p.len() as u32).to_le_bytes());
            msg.extend_from_slice(p);
        }
        hmac_sha256(&self.0, &msg)
    }

    /// Whether `proof` is this token's proof of `role` over `parts` (constant time).
    pub fn verify(&self, role: &str, parts: &[&[u8]], proof: &[u8]) -> bool {
        let want = self.prove(role, parts);
        proof.len() == PROOF
            && want
                .iter()
                .zip(proof)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

/// The two roles of a challenge-response: each side proves a different one, so neither
/// side's proof can be replayed as the other's. Every protocol has roles of its own (the mesh's
/// proofs are no use on the store, and the other way round).
pub struct Roles {
    /// The side that connected.
    pub dial: &'static str,
    /// The side that accepted.
    pub accept: &'static str,
}

fn denied(m: impl Into<String>) -> std::io::Error {
    std::io::Error::new(ErrorKind::PermissionDenied, m.into())
}

/// The proof parts: what the connection is for (`context`), then both nonces.
fn with_nonces<'a>(context: &[&'a [u8]], nonce_d: &'a [u8], nonce_a: &'a [u8]) -> Vec<&'a [u8]> {
    let mut parts = context.to_vec();
    parts.push(nonce_d);
    parts.push(nonce_a);
    parts
}

/// The accepting side of the challenge-response, once the dialer's hello (which carried its
/// nonce `nonce_d`) was read and checked: sends `prefix | nonce_a | proof(accept)`, reads the
/// dialer's proof before `deadline` and acknowledges it with one byte `1`.
///
/// # Errors
///
/// `PermissionDenied` when the dialer's proof is wrong (nothing more is sent: the caller drops
/// the connection); I/O errors and `TimedOut` as they come.
pub fn accept_challenge<S: Read + Write>(
    s: &mut S,
    token: &Token,
    roles: &Roles,
    prefix: &[u8],
    context: &[&[u8]],
    nonce_d: &[u8],
    deadline: Instant,
) -> std::io::Result<()> {
    let nonce_a = nonce()?;
    let parts = with_nonces(context, nonce_d, &nonce_a);
    let mut answer = Vec::with_capacity(prefix.len() + NONCE + PROOF);
    answer.extend_from_slice(prefix);
    answer.extend_from_slice(&nonce_a);
    answer.extend_from_slice(&token.prove(roles.accept, &parts));
    s.write_all(&answer)?;
    let mut proof = [0u8; PROOF];
    crate::store::read_full(s, &mut proof, Some(deadline), None)?;
    if !token.verify(roles.dial, &parts, &proof) {
        return Err(denied("the peer's proof does not match this job's token"));
    }
    s.write_all(&[1])
}

/// The dialing side of the challenge-response, once its hello (carrying `nonce_d`) was sent:
/// reads the acceptor's answer before `deadline` (`prefix_len` bytes that `check` accepts, its
/// nonce and its proof), verifies the proof, sends its own and waits for the acknowledgement.
///
/// # Errors
///
/// `PermissionDenied` when the acceptor's proof is wrong or it refuses ours; what `check`
/// returns; I/O errors and `TimedOut` as they come.
#[allow(clippy::too_many_arguments)]
pub fn dial_challenge<S: Read + Write>(
    s: &mut S,
    token: &Token,
    roles: &Roles,
    prefix_len: usize,
    check: impl FnOnce(&[u8]) -> std::io::Result<()>,
    context: &[&[u8]],
    nonce_d: &[u8],
    deadline: Instant,
) -> std::io::Result<()> {
    let mut answer = vec![0u8; prefix_len + NONCE + PROOF];
    crate::store::read_full(s, &mut answer, Some(deadline), None)?;
    check(&answer[..prefix_len])?;
    let nonce_a = &answer[prefix_len..prefix_len + NONCE];
    let parts = with_nonces(context, nonce_d, nonce_a);
    if !token.verify(roles.accept, &parts, &answer[prefix_len + NONCE..]) {
        return Err(denied(
            "the listener failed the token check (another job's process, or a wrong token)",
        ));
    }
    s.write_all(&token.prove(roles.dial, &parts))?;
    let mut ok = [0u8; 1];
    crate::store::read_full(s, &mut ok, Some(deadline), None)
        .map_err(|e| denied(format!("the peer refused our token proof ({e})")))?;
    if ok[0] != 1 {
        return Err(denied("the peer refused our token proof"));
    }
    Ok(())
}

/// A fresh nonce from the OS.
pub fn nonce() -> std::io::Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| std::io::Error::other(format!("no randomness: {e}")))?;
    Ok(n)
}

/// A fresh random token for a job (hex), for launchers.
///
/// # Errors
///
/// The OS has no randomness to give.
pub fn new_job_token() -> std::io::Result<String> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| std::io::Error::other(format!("no randomness: {e}")))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// HMAC-SHA256 (RFC 2104) of `msg` under `key`.
fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; PROOF] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    inner.update(msg);
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 1.
        assert_eq!(
            hex(&hmac_sha256(&[0x0b; 20], b"Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        // Test case 2.
        assert_eq!(
            hex(&hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: a key longer than the block.
        assert_eq!(
            hex(&hmac_sha256(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn proofs_bind_the_token_the_role_and_every_part() {
        let t = Token::new(b"secret");
        let p = t.prove("dial", &[b"ab", b"c"]);
        assert!(t.verify("dial", &[b"ab", b"c"], &p));
        assert!(!t.verify("accept", &[b"ab", b"c"], &p), "roles differ");
        assert!(
            !t.verify("dial", &[b"a", b"bc"], &p),
            "parts are length-prefixed"
        );
        assert!(!Token::new(b"other").verify("dial", &[b"ab", b"c"], &p));
        assert!(!t.verify("dial", &[b"ab", b"c"], &p[..31]));
        assert_eq!(format!("{t:?}"), "Token(..)");
        let a = new_job_token().unwrap();
        assert_eq!(a.len(), 64);
        assert_ne!(a, new_job_token().unwrap());
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }
}
