//! The README stays true: its first screen has exactly the two set-up
//! commands, and its metrics table is the one the code describes.

const README: &str = include_str!("../README.md");

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
    assert!(README.contains(&table), "README.md must carry this metrics table verbatim:\n{table}");
}
