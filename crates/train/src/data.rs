//! Training data: a token stream, generated ([`Corpus::synthetic`], the default: nothing to
//! download) or read from text ([`Corpus::bytes`], [`Corpus::from_tokens`] for a tokenizer's
//! ids), with a held-out split ([`Corpus::split`]).
//!
//! Synthetic tokens follow a sparse random Markov chain: each token has four likely successors (with
//! probabilities 0.55, 0.25, 0.12, 0.08), drawn from the seed. A model can learn it quickly (the
//! loss falls from `ln(vocab)` towards the chain's entropy, about 1.2 nats), which makes a
//! training curve that visibly moves within a minute on a small CPU. Batches are a function of
//! `(seed, step)` only, never of the mesh, so every layout trains on the same data.

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A token stream; see the module docs.
#[derive(Clone)]
pub struct Corpus {
    tokens: Vec<u32>,
    vocab: usize,
}

const PROBS: [f64; 4] = [0.55, 0.25, 0.12, 0.08];

impl std::fmt::Debug for Corpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Corpus({} tokens, vocab {}, fingerprint {:016x})",
            self.tokens.len(),
            self.vocab,
            self.fingerprint()
        )
    }
}

/// Why a corpus cannot be built or split.
#[derive(Debug, Clone, thiserror::Error)]
#[error("config: corpus: {0}")]
pub struct CorpusError(pub String);

fn bad(msg: String) -> CorpusError {
    CorpusError(msg)
}

impl Corpus {
    /// A corpus of `tokens` over a vocabulary of `vocab` ids (e.g. a tokenizer's output).
    ///
    /// # Errors
    ///
    /// No tokens, or a token outside the vocabulary.
    pub fn from_tokens(tokens: Vec<u32>, vocab: usize) -> Result<Self, CorpusError> {
        if tokens.is_empty() {
            return Err(bad("no tokens".into()));
        }
        if let Some((i, t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(bad(format!(
                "token {i} is {t}, outside the vocabulary of {vocab}"
            )));
        }
        Ok(Corpus { tokens, vocab })
    }

    /// Byte-level tokens of `text` (its UTF-8 bytes; vocabulary 256).
    ///
    /// # Errors
    ///
    /// Empty text.
    pub fn bytes(text: &str) -> Result<Self, CorpusError> {
        Corpus::from_tokens(text.bytes().map(u32::from).collect(), 256)
    }

    /// Splits off the last `eval_fraction` of the tokens as a held-out corpus (same
    /// vocabulary): `(train, eval)`, both at least `min_tokens` long (a window of the
    /// sequence length plus its next-token target).
    ///
    /// # Errors
    ///
    /// A fraction outside `(0, 1)`, or a part shorter than `min_tokens`.
    pub fn split(
        &self,
        eval_fraction: f64,
        min_tokens: usize,
    ) -> Result<(Corpus, Corpus), CorpusError> {
        if !(eval_fraction > 0.0 && eval_fraction < 1.0) {
            return Err(bad(format!(
                "the held-out fraction {eval_fraction} is not in (0, 1)"
            )));
        }
        let n = self.tokens.len();
        let at = n - ((n as f64 * eval_fraction).round() as usize).clamp(0, n);
        let (train, eval) = self.tokens.split_at(at);
        if train.len() < min_tokens || eval.len() < min_tokens {
            return Err(bad(format!(
                "{n} tokens split {} / {} (held-out fraction {eval_fraction}); each part needs \
                 at least {min_tokens} (a sequence and its next token): use more text or a \
                 shorter sequence",
                train.len(),
                eval.len()
            )));
        }
        Ok((
            Corpus {
                tokens: train.to_vec(),
                vocab: self.vocab,
            },
            Corpus {
                tokens: eval.to_vec(),
                vocab: self.vocab,
            },
        ))
    }

    /// The tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// A stable 64-bit fingerprint of the tokens and vocabulary (saved with checkpoints, so a
    /// resumed run can tell it trains on other data).
    pub fn fingerprint(&self) -> u64 {
        self.tokens
            .iter()
            .fold(splitmix64(self.vocab as u64), |h, &t| {
                splitmix64(h ^ u64::from(t))
            })
    }

    /// Generates `len` tokens over `vocab` from `seed`.
    pub fn synthetic(vocab: usize, len: usize, seed: u64) -> Self {
        let vocab = vocab.max(2);
        let succ = |a: usize, j: usize| {
            (splitmix64(seed ^ ((a as u64) << 8 | j as u64).wrapping_mul(0xA24B_AED4_963E_E407))
                % vocab as u64) as u32
        };
        let mut tokens = Vec::with_capacity(len);
        let mut cur = (splitmix64(seed) % vocab as u64) as usize;
        let mut state = seed ^ 0x5851_F42D_4C95_7F2D;
        for _ in 0..len {
            tokens.push(cur as u32);
            state = splitmix64(state);
            let u = (state >> 11) as f64 / (1u64 << 53) as f64;
            let mut acc = 0.0;
            let mut j = PROBS.len() - 1;
            for (k, p) in PROBS.iter().enumerate() {
                acc += p;
                if u < acc {
                    j = k;
                    break;
                }
            }
            cur = succ(cur, j) as usize;
        }
        Corpus { tokens, vocab }
    }

    /// The vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the corpus is empty.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The global batch of `step`: `batch` windows of `seq + 1` tokens at offsets drawn from
    /// `(seed, step)`, split into inputs and next-token targets, each `batch * seq` row-major.
    pub fn batch(&self, step: u64, batch: usize, seq: usize, seed: u64) -> (Vec<u32>, Vec<u32>) {
        let span = self.tokens.len().saturating_sub(seq + 1).max(1);
        let mut x = Vec::with_capacity(batch * seq);
        let mut y = Vec::with_capacity(batch * seq);
        for b in 0..batch {
            let off = (splitmix64(seed ^ splitmix64(step.wrapping_mul(1_000_003) + b as u64))
                % span as u64) as usize;
            let w = &self.tokens[off..(off + seq + 1).min(self.tokens.len())];
            x.extend_from_slice(&w[..seq.min(w.len().saturating_sub(1))]);
            y.extend_from_slice(&w[1..(seq + 1).min(w.len())]);
        }
        (x, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_split_and_fingerprint() {
        let text = "héllo wörld, ".repeat(10);
        let c = Corpus::bytes(&text).unwrap();
        assert_eq!(c.vocab(), 256);
        assert_eq!(
            c.tokens(),
            text.as_bytes()
                .iter()
                .map(|&b| u32::from(b))
                .collect::<Vec<_>>()
        );
        let (train, eval) = c.split(0.1, 9).unwrap();
        // The held-out part is the end of the text, in order; together they are the text.
        assert_eq!(eval.len(), (c.len() as f64 * 0.1).round() as usize);
        assert_eq!([train.tokens(), eval.tokens()].concat(), c.tokens());
        assert_eq!(c.fingerprint(), Corpus::bytes(&text).unwrap().fingerprint());
        assert_ne!(c.fingerprint(), train.fingerprint());
        // Too little text for the sequence, fractions out of range, empty text, bad ids.
        assert!(c
            .split(0.1, 50)
            .unwrap_err()
            .to_string()
            .contains("at least 50"));
        assert!(c.split(1.0, 1).is_err() && c.split(0.0, 1).is_err());
        assert!(Corpus::bytes("").is_err());
        let e = Corpus::from_tokens(vec![1, 7], 5).unwrap_err().to_string();
        assert!(e.contains("token 1 is 7"), "{e}");
        // Windows of a text corpus stay inside it and are deterministic.
        let (x, y) = train.batch(3, 2, 8, 1);
        assert_eq!((x, y), train.batch(3, 2, 8, 1));
    }

    #[test]
    fn deterministic_and_in_range() {
        let a = Corpus::synthetic(512, 10_000, 1);
        let b = Corpus::synthetic(512, 10_000, 1);
        assert_eq!(a.batch(3, 2, 8, 9), b.batch(3, 2, 8, 9));
        let (x, y) = a.batch(0, 4, 16, 0);
        assert_eq!((x.len(), y.len()), (64, 64));
        assert!(x.iter().chain(&y).all(|&t| (t as usize) < 512));
        assert_eq!(x[1..16], y[..15]);
    }
}
