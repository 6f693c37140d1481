//! The operator's key that seals secrets at rest: an account's values and
//! its sandboxes' CA keys are stored only as XChaCha20-Poly1305 sealed
//! them under it, so a copy of the database (a backup, a replica, a stolen
//! disk) holds no credential without the key file beside it.
//!
//! Why this shape: a random 24-byte nonce per sealing (XChaCha's nonces are
//! long enough to be drawn at random without ever repeating in practice),
//! stored in front of the ciphertext; the associated data binds a sealed
//! value to its place (an account's secret by name, a sandbox's CA key), so
//! one moved to another row does not open there.
//!
//! The key is 64 hex characters in a file only its owner reads:
//! `[secrets] key_file`, or `<data_dir>/secrets.key`, made at the first
//! start. Members of a cluster on one database must share it.

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use std::path::Path;

/// Bytes of the nonce in front of every sealed value.
const NONCE_BYTES: usize = 24;

/// The key secrets are sealed with (32 bytes); wiped when dropped, never
/// shown by `Debug`.
#[derive(Clone)]
pub struct SecretsKey([u8; 32]);

impl std::fmt::Debug for SecretsKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretsKey(<redacted>)")
    }
}

impl Drop for SecretsKey {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.0);
    }
}

/// A new random key: what a process without a configured one seals with
/// (tests, benchmarks); nothing it sealed opens in another process.
impl Default for SecretsKey {
    fn default() -> Self {
        SecretsKey::random()
    }
}

impl SecretsKey {
    /// A new key from the OS's random source.
    pub fn random() -> SecretsKey {
        SecretsKey(rand::random())
    }

    /// A key written as 64 hex characters (whitespace around them ignored).
    pub fn from_hex(text: &str) -> Result<SecretsKey, String> {
        let text = text.trim();
        let bytes = hex::decode(text)
            .ok()
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
            .ok_or_else(|| {
                format!(
                    "a secrets key is 64 hex characters (32 bytes), not {} characters of that",
                    text.len()
                )
            })?;
        Ok(SecretsKey(bytes))
    }

    /// The key in file `path`, which must be its owner's alone.
    pub fn load(path: &Path) -> Result<SecretsKey, String> {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display();
        let mode = std::fs::metadata(path)
            .map_err(|e| format!("[secrets] key_file {shown}: {e}"))?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            return Err(format!(
                "[secrets] key_file {shown} can be read by others (mode {:o}): it must be its \
                 owner's alone; run `chmod 600 {shown}`",
                mode & 0o777
            ));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("[secrets] key_file {shown}: {e}"))?;
        SecretsKey::from_hex(&text).map_err(|e| {
            format!(
                "[secrets] key_file {shown}: {e}; make one with `openssl rand -hex 32 > {shown}`"
            )
        })
    }

    /// The key in file `path`, made (random, mode 0600) if there is none.
    /// Two processes that start together make one key: the file is
    /// created only if absent and written whole, and the one that did not
    /// make it reads it.
    pub fn load_or_create(path: &Path) -> Result<SecretsKey, String> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        // Written to a file of its own first, then linked into place
        // (which fails if the key exists): a reader never sees half a key.
        let fresh = SecretsKey::random();
        let dir = path.parent().unwrap_or(Path::new("."));
        let draft = dir.join(format!(
            ".secrets.key.{}.{}",
            std::process::id(),
            hex::encode(rand::random::<[u8; 6]>())
        ));
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&draft)
            .and_then(|mut f| {
                f.write_all(format!("{}\n", hex::encode(fresh.0)).as_bytes())?;
                f.sync_all()
            });
        let linked = written.and_then(|()| std::fs::hard_link(&draft, path));
        let _ = std::fs::remove_file(&draft);
        match linked {
            Ok(()) => {
                tracing::info!("made a new secrets key in {}", path.display());
                Ok(fresh)
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => SecretsKey::load(path),
            Err(e) => Err(format!(
                "making the secrets key {}: {e} (or set [secrets] key_file)",
                path.display()
            )),
        }
    }

    /// `plaintext` sealed for `place` (the associated data): a random
    /// nonce, then the ciphertext and its tag.
    pub fn seal(&self, plaintext: &[u8], place: &[u8]) -> Vec<u8> {
        let nonce: [u8; NONCE_BYTES] = rand::random();
        let sealed = self
            .cipher()
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: plaintext,
                    aad: place,
                },
            )
            .expect("XChaCha20-Poly1305 seals any message of a secret's size");
        [nonce.as_slice(), &sealed].concat()
    }

    /// What [`SecretsKey::seal`] sealed for `place`; an error when it was
    /// sealed under another key, for another place, or was changed.
    pub fn open(&self, sealed: &[u8], place: &[u8]) -> Result<Vec<u8>, String> {
        if sealed.len() < NONCE_BYTES {
            return Err("a sealed value too short to hold its nonce".into());
        }
        let (nonce, ciphertext) = sealed.split_at(NONCE_BYTES);
        self.cipher()
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: ciphertext,
                    aad: place,
                },
            )
            .map_err(|_| {
                "a sealed value does not open: sealed under another key (is [secrets] key_file \
                 the one it was sealed with?), for another place, or changed"
                    .to_string()
            })
    }

    /// A signature of `message` under this key (HMAC-SHA-256 with a key
    /// of its own, derived for signing, so that no signature says anything
    /// of the sealing key): tokens the server checks without storing them.
    pub fn sign(&self, message: &[u8]) -> [u8; 32] {
        use hmac::{Hmac, Mac};
        let mut derive =
            <Hmac<sha2::Sha256> as Mac>::new_from_slice(&self.0).expect("any key length");
        derive.update(b"sandpit signing key");
        let signing = derive.finalize().into_bytes();
        let mut mac =
            <Hmac<sha2::Sha256> as Mac>::new_from_slice(&signing).expect("any key length");
        mac.update(message);
        mac.finalize().into_bytes().into()
    }

    fn cipher(&self) -> XChaCha20Poly1305 {
        XChaCha20Poly1305::new((&self.0).into())
    }
}

/// Where a secret's value is sealed: its account and name.
pub fn secret_place(account_id: &str, name: &str) -> Vec<u8> {
    [account_id.as_bytes(), b"\0", name.as_bytes()].concat()
}

/// Where a sandbox's CA key is sealed: its sandbox.
pub fn broker_ca_place(sandbox_id: &str) -> Vec<u8> {
    [b"broker-ca\0".as_slice(), sandbox_id.as_bytes()].concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_value_opens_in_its_place_only_and_is_not_stored_in_clear() {
        let key = SecretsKey::random();
        let value = b"sk-live-0123456789abcdef";
        let place = secret_place("acct_a", "OPENAI_API_KEY");
        let sealed = key.seal(value, &place);
        assert_eq!(key.open(&sealed, &place).unwrap(), value);
        // Not in clear, and a new nonce each time.
        assert!(!sealed.windows(value.len()).any(|w| w == value));
        assert_ne!(sealed, key.seal(value, &place));
        // Another account's, another name's, another key's: none opens.
        for other in [
            secret_place("acct_b", "OPENAI_API_KEY"),
            secret_place("acct_a", "OPENAI_API_KEY2"),
            secret_place("acct_aO", "PENAI_API_KEY"),
            broker_ca_place("sbx_1"),
        ] {
            assert!(key.open(&sealed, &other).is_err());
        }
        assert!(SecretsKey::random().open(&sealed, &place).is_err());
        let mut changed = sealed.clone();
        *changed.last_mut().unwrap() ^= 1;
        assert!(key.open(&changed, &place).is_err());
        assert!(key.open(&sealed[..10], &place).is_err());
    }

    #[test]
    fn a_key_file_is_made_once_read_back_and_refused_when_others_read_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secrets.key");
        let made = SecretsKey::load_or_create(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = SecretsKey::load_or_create(&path).unwrap();
        assert_eq!(made.0, again.0);
        assert_eq!(SecretsKey::load(&path).unwrap().0, made.0);
        // Only the key is left in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

        // Made at once by many: one key for all.
        let racing = dir.path().join("racing.key");
        let keys: Vec<[u8; 32]> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| s.spawn(|| SecretsKey::load_or_create(&racing).unwrap().0))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(keys.iter().all(|k| *k == keys[0]));

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = SecretsKey::load(&path).unwrap_err();
        assert!(e.contains("chmod 600"), "{e}");
        assert!(SecretsKey::load_or_create(&path).is_err());

        let short = dir.path().join("short.key");
        std::fs::write(&short, "abcd\n").unwrap();
        std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = SecretsKey::load(&short).unwrap_err();
        assert!(e.contains("64 hex characters"), "{e}");
        let written = dir.path().join("written.key");
        std::fs::write(&written, format!("  {}\n", "ab".repeat(32))).unwrap();
        std::fs::set_permissions(&written, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(SecretsKey::load(&written).unwrap().0, [0xab; 32]);
        assert!(SecretsKey::load(&dir.path().join("missing.key")).is_err());
    }
}
