//! The README and the docs stay true: the README's first screen has exactly
//! the two set-up commands and the whole page stays a five-minute read; the
//! metrics page carries the table the code describes. (The generated blocks,
//! the side-by-side excerpt and the cost table, are checked by the docs
//! build: docs/gen.py.)

const README: &str = include_str!("../../README.md");
const METRICS_PAGE: &str = include_str!("../../docs/metrics.md");

#[test]
fn the_readme_stays_short() {
    let lines = README.lines().count();
    assert!(lines <= 250, "README.md has {lines} lines: move detail into docs/ (the limit is 250)");
}

#[test]
fn the_first_screen_has_exactly_the_two_commands() {
    let first_screen: Vec<&str> = README.lines().take(30).collect();
    let start = first_screen.iter().position(|l| l.trim() == "```sh").expect("a ```sh block on the first screen");
    let end = start + 1 + first_screen[start + 1..].iter().position(|l| l.trim() == "```").expect("the block ends");
    let commands: Vec<&str> = first_screen[start + 1..end]
        .iter()
        .map(|l| l.split('#').next().unwrap().trim())
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(commands, ["scripts/train", "scripts/test"]);
    for script in ["scripts/train", "scripts/test"] {
        assert!(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(script).is_file(), "{script} is missing");
    }
}

#[test]
fn the_metrics_table_matches_the_code() {
    let table = gradsync::metrics::markdown_table();
    assert!(METRICS_PAGE.contains(&table), "docs/metrics.md must carry this metrics table verbatim:\n{table}");
}
