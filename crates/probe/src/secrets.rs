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

fn normalise(s: &str) -> String {
    s.chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect()
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

    /// The first piece of this secret found in `output` (normalised), if any.
    pub fn found_in(&self, output: &str) -> Option<String> {
        let out = normalise(output);
        self.pieces
            .iter()
            .find(|p| out.contains(&normalise(p)))
            .cloned()
    }
}

/// A prompt of about `words` words of filler that carries `secret` and
/// asks for it back; `nonce` makes it unique.
pub fn prompt_with_secret(nonce: u64, words: usize, secret: &Secret) -> String {
    let mut s = format!("Note {nonce:016x}. ");
    s += &filler(nonce, words);
    s += &format!(
        " Remember this access code exactly: {}. Repeat the access code: ",
        secret.text()
    );
    s
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

/// `units` repetitions of one short word after a nonce: a prompt whose
/// token count grows by a fixed step per unit on any tokenizer that
/// gives the word one token (checked, not assumed: see `checks`).
pub fn unit_prompt(nonce: u64, units: usize) -> String {
    format!("Note {nonce:016x}.{}", " hello".repeat(units))
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
        assert_eq!(s.found_in("to paz 00 07"), Some("topaz0007".into()));
        assert_eq!(s.found_in("lemur 4822 and 4821"), None);
    }

    #[test]
    fn prompts_carry_their_secret_and_differ_by_nonce() {
        let mut r = crate::rng(1);
        let s = Secret::generate(&mut r, 1, 0);
        let a = prompt_with_secret(1, 200, &s);
        let b = prompt_with_secret(2, 200, &s);
        assert!(s.found_in(&a).is_some());
        assert_ne!(a, b);
        let words = a.split_whitespace().count();
        assert!((200..260).contains(&words), "{words}");
    }
}
