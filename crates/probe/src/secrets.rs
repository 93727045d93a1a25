//! Secrets and prompts. A secret is a few *pieces*, each an uncommon word
//! glued to four random digits (`lemur4821`): a piece has 40 × 10⁴
//! possible values, so one appearing in an output that was never shown it
//! is a leak, not chance; the digits alone are not counted.

use rand::Rng;

const WORDS: [&str; 40] = [
    "quartz", "lemur", "fjord", "cobalt", "walrus", "zephyr", "saffron", "obsidian", "marmot",
    "tundra", "quokka", "basalt", "heron", "juniper", "krypton", "lagoon", "mango", "nebula",
    "ocelot", "pewter", "quince", "raven", "sequoia", "topaz", "umber", "vortex", "wombat",
    "xylem", "yarrow", "zircon", "alpaca", "bramble", "cinder", "dingo", "ember", "falcon",
    "garnet", "hazel", "iguana", "jasper",
];

/// Filler prose for long prompts (varied per request by the nonce and
/// the order of sentences, so no prefix cache can answer for it).
const FILLER: [&str; 12] = [
    "The committee reviewed the quarterly figures and asked for a second opinion.",
    "Rain fell steadily over the harbour while the ferries waited for the tide.",
    "A careful engineer writes the test before she trusts the code.",
    "The library opened a new wing devoted to maps of forgotten coastlines.",
    "Several travellers reported that the mountain road was closed by snow.",
    "In the old market, spice merchants argued about the price of cardamom.",
    "The orchestra rehearsed the slow movement until the strings agreed.",
    "Every lighthouse keeper kept a logbook of the ships that passed at night.",
    "The gardeners planted tulips along the canal in neat and patient rows.",
    "A small bakery on the corner sold bread that was still warm at dawn.",
    "The students compared their notes and found three different answers.",
    "Engineers inspected the bridge and measured how far it swayed in the wind.",
];

/// One request's secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Secret {
    pub tenant: usize,
    /// Which of the tenant's prompts it is in.
    pub prompt: usize,
    pub pieces: Vec<String>,
}

/// Lowercase ASCII letters and digits; every run of anything else
/// becomes one space.
fn normalise(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with(' ') {
            out.push(' ');
        }
    }
    out
}

/// Whether `text` (normalised) holds `word` starting a word, then (after
/// optional spaces, so a piece split by punctuation or tokens is still
/// found) `digits` not followed by another digit: `lemur4821`,
/// `LEMUR-4821`, `lemur 4821` — but not `slemur4821` or `lemur48210`.
fn holds_piece(text: &str, word: &str, digits: &str) -> bool {
    let b = text.as_bytes();
    let mut from = 0;
    while let Some(i) = text[from..].find(word).map(|i| i + from) {
        from = i + 1;
        if i > 0 && b[i - 1].is_ascii_alphanumeric() {
            continue;
        }
        let mut j = i + word.len();
        while j < b.len() && b[j] == b' ' {
            j += 1;
        }
        if text[j..].starts_with(digits) {
            let end = j + digits.len();
            if end == b.len() || !b[end].is_ascii_digit() {
                return true;
            }
        }
    }
    false
}

impl Secret {
    pub fn generate(rng: &mut impl Rng, tenant: usize, prompt: usize) -> Secret {
        let pieces = (0..4)
            .map(|_| {
                let w = WORDS[rng.gen_range(0..WORDS.len())];
                format!("{w}{:04}", rng.gen_range(0..10_000))
            })
            .collect();
        Secret {
            tenant,
            prompt,
            pieces,
        }
    }

    pub fn text(&self) -> String {
        self.pieces.join("-")
    }

    /// The first piece of this secret found in `output`, if any (see
    /// `holds_piece` for what counts).
    pub fn found_in(&self, output: &str) -> Option<String> {
        let out = normalise(output);
        self.pieces
            .iter()
            .find(|p| {
                let split = p.find(|c: char| c.is_ascii_digit()).unwrap_or(p.len());
                holds_piece(&out, &p[..split], &p[split..])
            })
            .cloned()
    }

    /// The first piece of this secret found in the tokens an output was
    /// made of (as the server reports them, `logprobs.tokens`), read as the
    /// text they spell: a piece split over several tokens is found, and so
    /// is one the server's `text` left out or rendered differently.
    pub fn found_in_tokens(&self, tokens: &[String]) -> Option<String> {
        self.found_in(&spelled(tokens))
    }

    /// `counts[t]` secrets for tenant `t`, no piece shared by two.
    pub fn generate_unique(rng: &mut impl Rng, counts: &[usize]) -> Vec<Secret> {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for (tenant, &n) in counts.iter().enumerate() {
            for prompt in 0..n {
                // Bounded: a collision has odds below 1 in 10 000 a piece.
                let mut s = Secret::generate(rng, tenant, prompt);
                for _ in 0..100 {
                    if s.pieces.iter().all(|p| !seen.contains(p)) {
                        break;
                    }
                    s = Secret::generate(rng, tenant, prompt);
                }
                seen.extend(s.pieces.iter().cloned());
                out.push(s);
            }
        }
        out
    }
}

/// The text a token sequence spells. Byte-level BPE vocabularies show a
/// leading space as `Ġ` and a newline as `Ċ`, SentencePiece a space as `▁`;
/// servers differ in whether they map these back, so both are read.
fn spelled(tokens: &[String]) -> String {
    let mut s = String::new();
    for t in tokens {
        for c in t.chars() {
            s.push(match c {
                'Ġ' | '▁' => ' ',
                'Ċ' => '\n',
                c => c,
            });
        }
    }
    s
}

/// A prompt of about `words` words of filler that carries `secret` and
/// asks for it back; `nonce` makes it unique.
/// The secret is stated after every [`SECRET_EVERY_WORDS`] words of
/// filler, not only at the end: its KV then lies in most of the prompt's
/// pages, so a server that hands those pages to another request unwritten
/// (the incident) hands over the secret with whichever pages it reuses.
pub fn prompt_with_secret(nonce: u64, words: usize, secret: &Secret) -> String {
    secret_every(nonce, words, secret, SECRET_EVERY_WORDS)
}

/// Like [`prompt_with_secret`], the secret stated after every `every`
/// words of filler.
fn secret_every(nonce: u64, words: usize, secret: &Secret, every: usize) -> String {
    let every = every.max(1);
    let code = secret.text();
    let mut s = format!("Note {:016x}. ", shown(nonce));
    // A statement of the code costs about as many tokens as 23 words of
    // prose: keep the whole prompt near `words` words' worth.
    let body = filler(nonce, words * every / (every + 23));
    let mut n = 0;
    for w in body.split(' ') {
        s += w;
        s.push(' ');
        n += 1;
        if n % every == 0 {
            s += &format!("The access code is {code}. ");
        }
    }
    s += &format!("Remember this access code exactly: {code}. Repeat the access code: ");
    s
}

/// A flood prompt of about `words` words: the secret stated after every
/// [`FLOOD_SECRET_EVERY_WORDS`] words of filler, ending in a request for
/// it. KV left behind by it holds that secret every few words wherever it
/// is read, so a server that serves another request from it (the
/// incident) soon recites the secret: over prose with the secret every 40
/// words, the fault-incident build recited the prose; over nothing but
/// statements of the secret, a date.
pub fn flood_prompt(nonce: u64, words: usize, secret: &Secret) -> String {
    secret_every(nonce, words, secret, FLOOD_SECRET_EVERY_WORDS)
}

/// Filler words between two statements of a flood prompt's secret.
pub const FLOOD_SECRET_EVERY_WORDS: usize = 4;

/// Filler words between two statements of a prompt's secret.
pub const SECRET_EVERY_WORDS: usize = 40;

/// How a nonce is written into a prompt: a bijective mix (splitmix64's
/// finaliser), so consecutive nonces differ from their first hex digit and
/// two prompts share no token after "Note " — no honest prefix cache can
/// serve a timed prompt from an earlier one. (The nonce itself still picks
/// the filler, which the token-accounting heuristics are tuned to.)
pub fn shown(nonce: u64) -> u64 {
    let mut z = nonce.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// About `words` words of filler prose, in an order `nonce` picks.
pub fn filler(nonce: u64, words: usize) -> String {
    let mut s = String::new();
    let mut n = 0;
    let mut i = nonce as usize;
    while n < words {
        let sentence = FILLER[i % FILLER.len()];
        n += sentence.split_whitespace().count();
        s += sentence;
        s.push(' ');
        i = i.wrapping_mul(7).wrapping_add(3);
    }
    s.truncate(s.trim_end().len());
    s
}

/// About `words` words of filler after a nonce, asking for a one-word
/// summary: the prefix-cache check's prompts (the nonce first, so no
/// earlier prompt shares even their first page).
pub fn cache_prompt(nonce: u64, words: usize) -> String {
    format!(
        "Note {:016x}. {} Summarise the note in one word:",
        shown(nonce),
        filler(nonce, words)
    )
}

/// A story opening no one has sent before (the nonce, and words it
/// picks): its greedy continuation is text only this prompt leads to.
pub fn story_prompt(nonce: u64) -> String {
    let mut x = shown(nonce);
    let words: Vec<&str> = (0..12)
        .map(|_| {
            x = shown(x);
            WORDS[(x % WORDS.len() as u64) as usize]
        })
        .collect();
    format!(
        "Story {:08x}. A tale about {}. Once upon a time,",
        shown(nonce) as u32,
        words.join(" ")
    )
}

/// A JSON schema no one has sent before (its property names carry the
/// nonce): an object of `properties` optional strings, each with its own
/// pattern, so that compiling it takes a measurable time (88 ms mean for
/// 800 on isoserve's 2-core machine) and a cached compile does not.
pub fn grammar_schema(nonce: u64, properties: usize) -> String {
    let props: Vec<String> = (0..properties)
        .map(|i| {
            format!(
                r#""k{:x}_{i}":{{"type":"string","maxLength":16,"pattern":"^[a-z]{{1,8}}{i}$"}}"#,
                shown(nonce)
            )
        })
        .collect();
    format!(
        r#"{{"type":"object","properties":{{{}}},"additionalProperties":false}}"#,
        props.join(",")
    )
}

/// `units` repetitions of one short word after a nonce: a prompt whose
/// token count grows by a fixed step per unit on any tokenizer that
/// gives the word one token (checked, not assumed: see `checks`).
pub fn unit_prompt(nonce: u64, units: usize) -> String {
    format!("Note {:016x}.{}", shown(nonce), " hello".repeat(units))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_is_found_across_case_spacing_and_punctuation() {
        let s = Secret {
            tenant: 0,
            prompt: 0,
            pieces: vec!["lemur4821".into(), "topaz0007".into()],
        };
        assert_eq!(s.found_in("code: LEMUR-4821!"), Some("lemur4821".into()));
        assert_eq!(s.found_in("TOPAZ 0007"), Some("topaz0007".into()));
        assert_eq!(s.found_in("lemur 4822 and 4821"), None);
        // Whole words and whole numbers only.
        assert_eq!(s.found_in("slemur4821"), None);
        assert_eq!(s.found_in("lemur48210"), None);
        assert_eq!(s.found_in("(lemur)4821."), Some("lemur4821".into()));
    }

    #[test]
    fn a_piece_is_found_across_tokens_in_either_spelling() {
        let s = Secret {
            tenant: 0,
            prompt: 0,
            pieces: vec!["lemur4821".into()],
        };
        let toks = |t: &[&str]| t.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        for t in [
            toks(&[" the", " le", "mur", "4", "8", "2", "1"]),
            toks(&["Ġthe", "Ġle", "mur", "-", "4", "8", "21"]),
            toks(&["▁LEM", "UR", "▁", "4821", "."]),
        ] {
            assert_eq!(s.found_in_tokens(&t), Some("lemur4821".into()), "{t:?}");
        }
        assert_eq!(
            s.found_in_tokens(&toks(&["Ġle", "mur", "4", "8", "2"])),
            None
        );
        assert_eq!(s.found_in_tokens(&[]), None);
    }

    #[test]
    fn a_flood_prompt_states_its_secret_every_few_words() {
        let mut r = crate::rng(5);
        let s = Secret::generate(&mut r, 0, 0);
        let p = flood_prompt(9, 400, &s);
        assert!(p.starts_with(&format!("Note {:016x}. ", shown(9))), "{p}");
        // Consecutive nonces are written apart from their first digit.
        let (a, b) = (format!("{:016x}", shown(9)), format!("{:016x}", shown(10)));
        assert_ne!(a[..1], b[..1], "{a} {b}");
        let stated = p.matches(&s.text()).count();
        let words = p.split_whitespace().count();
        // A statement (5 words) after every few words of filler, about 400
        // words' worth of tokens in all (a statement costs as many as 23).
        let per_statement = FLOOD_SECRET_EVERY_WORDS + 5;
        assert!(
            stated + 1 >= words / per_statement,
            "{stated} statements in {words} words"
        );
        assert!((100..400).contains(&words), "{words}");
        assert!(p.ends_with("Repeat the access code: "), "{p}");
        assert_ne!(flood_prompt(10, 400, &s), p);
    }

    #[test]
    fn unique_secrets_share_no_piece_and_count_per_tenant() {
        let mut r = crate::rng(3);
        let all = Secret::generate_unique(&mut r, &[3, 1]);
        assert_eq!(all.iter().filter(|s| s.tenant == 0).count(), 3);
        assert_eq!((all[3].tenant, all[3].prompt), (1, 0));
        let pieces: Vec<_> = all.iter().flat_map(|s| s.pieces.iter()).collect();
        let set: std::collections::HashSet<_> = pieces.iter().collect();
        assert_eq!(set.len(), pieces.len());
    }

    #[test]
    fn prompts_carry_their_secret_and_differ_by_nonce() {
        let mut r = crate::rng(1);
        let s = Secret::generate(&mut r, 1, 0);
        let a = prompt_with_secret(1, 200, &s);
        let b = prompt_with_secret(2, 200, &s);
        assert!(s.found_in(&a).is_some());
        assert_ne!(a, b);
        // 200 words' worth: 126 of prose, the code after every 40 of them
        // and at the end.
        assert_eq!(
            a.matches(&s.text()).count(),
            126 / SECRET_EVERY_WORDS + 1,
            "{a}"
        );
        let words = a.split_whitespace().count();
        assert!((130..200).contains(&words), "{words}");
    }
}
