//! Writes the tiny model of each architecture
//! (`testkit::synthetic::architecture_cases`) into a directory, as
//! `tiny-<name>.gguf`: the files scripts/compare-llama-cpp runs through
//! llama.cpp and isoserve.
//!
//! `cargo run --release -p testkit --example write-tiny-models -- DIR`

fn main() {
    let dir = std::env::args().nth(1).unwrap_or_else(|| {
        eprintln!("usage: write-tiny-models DIR");
        std::process::exit(2)
    });
    std::fs::create_dir_all(&dir).expect("create the directory");
    for (name, cfg) in testkit::synthetic::architecture_cases() {
        let path = std::path::Path::new(&dir).join(format!("tiny-{name}.gguf"));
        testkit::synthetic::write_synthetic_llama(&path, cfg, 7).expect("write the model");
        println!("{}", path.display());
    }
}
