//! The layout README's "Layout" and "Queries" describe, held to by the sources themselves:
//! every statement of the product crates checked at compile time, no module of a crate
//! importing another in a circle, the processor library free of the command line's
//! dependencies, the handler crate free of the server's, the fault points only in the
//! tests' builds, no tokio worker put to sleep or left to poll the consumer, every task the
//! processor starts owned and joined, and no function of the processor longer than a reader
//! takes in at once; and every end-to-end test file compiled into the suite.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

const PRODUCT_CRATES: [&str; 5] = ["common", "relay", "processor", "cli", "examples"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every `.rs` file under `dir`, with its path relative to `dir`.
fn sources(dir: &Path) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                found.push((relative, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    found.sort();
    found
}

/// The lines of `text` that are code, not comments.
fn code(text: &str) -> impl Iterator<Item = &str> {
    text.lines().filter(|l| !l.trim_start().starts_with("//"))
}

#[test]
fn every_statement_of_the_product_crates_is_checked_at_compile_time() {
    // Calls that take SQL as a runtime string, and the places allowed one, with why.
    let runtime = [
        "sqlx::query(",
        "query::<",
        "sqlx::query_as(",
        "sqlx::query_scalar(",
        "query_as::<",
        "query_scalar::<",
        "QueryBuilder",
        "sqlx::raw_sql(",
    ];
    let allowed = BTreeMap::from([
        // The log read: the literal `query!` checks (claim_statement!), run zero-copy.
        ("relay/src/log.rs", 1),
        // A database's name, quoted by Postgres's format('%I') in a checked query.
        ("common/src/db.rs", 2),
        // The bench's own tables: cli/sql/bench.sql, which docker/sqlx.sh applies too.
        ("cli/src/bench.rs", 1),
    ]);
    let mut found: BTreeMap<String, usize> = BTreeMap::new();
    for krate in PRODUCT_CRATES {
        for (file, text) in sources(&root().join(krate).join("src")) {
            let calls = code(&text)
                .map(|line| runtime.iter().filter(|call| line.contains(*call)).count())
                .sum::<usize>();
            if calls > 0 {
                found.insert(format!("{krate}/src/{file}"), calls);
            }
        }
    }
    let allowed: BTreeMap<String, usize> =
        allowed.into_iter().map(|(file, n)| (file.to_owned(), n)).collect();
    assert_eq!(
        found, allowed,
        "SQL run from a runtime string: make it a sqlx::query! (README, \"Queries\")"
    );
    // The checked ones are there: one offline data file per statement.
    let checked = std::fs::read_dir(root().join(".sqlx")).unwrap().count();
    assert!(checked >= 100, "only {checked} statements in .sqlx/");
}

#[test]
fn no_module_of_a_crate_imports_another_in_a_circle() {
    for krate in ["common", "relay", "processor", "cli"] {
        // Each top-level module and the modules its code (not its comments) names.
        let mut uses: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (file, text) in sources(&root().join(krate).join("src")) {
            let module = file.split(['/', '.']).next().unwrap().to_owned();
            if module == "lib" || module == "main" || module == "bin" {
                continue;
            }
            let named = uses.entry(module.clone()).or_default();
            for line in code(&text) {
                for (at, _) in line.match_indices("crate::") {
                    let rest = &line[at + "crate::".len()..];
                    let end = rest
                        .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                        .unwrap_or(rest.len());
                    let other = &rest[..end];
                    if !other.is_empty() && other != module {
                        named.insert(other.to_owned());
                    }
                }
            }
        }
        for (module, named) in &uses {
            // A module reaching itself through those it names is a circle.
            let mut seen = BTreeSet::new();
            let mut stack: Vec<&String> = named.iter().collect();
            while let Some(next) = stack.pop() {
                assert_ne!(next, module, "{krate}: {module} imports itself through {seen:?}");
                if seen.insert(next.clone()) {
                    stack.extend(uses.get(next).into_iter().flatten());
                }
            }
        }
    }
}

#[test]
fn the_processor_library_depends_on_nothing_only_the_command_line_needs() {
    let tree = cargo_tree(&["-p", "jobfold-processor", "-e", "normal"]);
    assert!(tree.contains("jobfold-common"), "{tree}");
    for dependency in ["arrow", "parquet", "indicatif", "jobfold-relay", "jobfold-cli"] {
        assert!(
            !tree.lines().any(|l| l.contains(&format!(" {dependency}"))),
            "jobfold-processor depends on {dependency}:\n{tree}"
        );
    }
}

/// `cargo tree` of the workspace, from its root, with `args`.
fn cargo_tree(args: &[&str]) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let tree = Command::new(cargo)
        .args(["tree", "--locked", "--offline"])
        .args(args)
        .current_dir(root())
        .output()
        .expect("running cargo tree");
    assert!(tree.status.success(), "{}", String::from_utf8_lossy(&tree.stderr));
    String::from_utf8(tree.stdout).unwrap()
}

#[test]
fn a_handler_crate_depends_on_no_server_broker_or_database_client() {
    let tree = cargo_tree(&["-p", "jobfold-handler", "-e", "normal"]);
    assert!(tree.contains("tokio-util"), "{tree}");
    for dependency in ["axum", "rdkafka", "sqlx", "tokio-postgres", "jobfold-"] {
        let named = tree.lines().skip(1).filter(|l| l.contains(&format!(" {dependency}")));
        assert_eq!(named.count(), 0, "jobfold-handler depends on {dependency}:\n{tree}");
    }
    // Its Postgres commit is a feature the processor turns on, not the handler crate.
    let with_commit = cargo_tree(&["-p", "jobfold-handler", "-e", "normal", "-F", "postgres"]);
    assert!(with_commit.lines().any(|l| l.contains(" sqlx ")), "{with_commit}");
}

#[test]
fn the_shipped_builds_have_no_fault_points() {
    // `cargo build --release` (the default members) and the Dockerfile's package set leave
    // jobfold-common's `failpoints` off; the tests' builds (`--workspace`) turn it on.
    // docker/test.sh checks the shipped binaries themselves with nm and strings.
    let shipped = ["-p", "jobfold-relay", "-p", "jobfold-processor", "-p", "jobfold-cli"];
    for packages in [&[][..], &shipped[..]] {
        let tree = cargo_tree(&[packages, &["-e", "features", "-i", "jobfold-common"]].concat());
        assert!(tree.contains("jobfold-common"), "{tree}");
        assert!(!tree.contains("failpoints"), "{packages:?} builds fault points:\n{tree}");
    }
    let tests = cargo_tree(&["--workspace", "-e", "features", "-i", "jobfold-common"]);
    assert!(tests.contains("jobfold-common feature \"failpoints\""), "{tests}");
}

#[test]
fn no_thread_sleeps_on_a_tokio_worker() {
    // `std::thread::sleep` blocks the thread it runs on: only on threads of their own, each
    // place with why. Anything else waits with tokio's timers.
    let allowed = BTreeMap::from([
        // The revoke callback, inside a poll of the consumer's own thread (worker::consume).
        ("processor/src/worker/consumer.rs".to_owned(), 1),
        // Waiting for new topics' leaders, inside spawn_blocking.
        ("common/src/kafka.rs".to_owned(), 1),
    ]);
    let mut found = BTreeMap::new();
    for krate in PRODUCT_CRATES {
        for (file, text) in sources(&root().join(krate).join("src")) {
            let sleeps = code(&text).filter(|line| line.contains("thread::sleep")).count();
            if sleeps > 0 {
                found.insert(format!("{krate}/src/{file}"), sleeps);
            }
        }
    }
    assert_eq!(found, allowed, "std::thread::sleep outside a thread of its own");
}

/// The lines each function of `text` spans, from its `fn` to its body's closing brace:
/// (name, first line, lines). A scan that skips comments, strings (raw ones too) and
/// character literals, so that a brace inside them is not counted.
fn function_lengths(text: &str) -> Vec<(String, usize, usize)> {
    let bytes = text.as_bytes();
    let mut found = Vec::new();
    // Bodies open: (name, first line, the brace depth inside it).
    let mut open: Vec<(String, usize, usize)> = Vec::new();
    // A function whose body has not begun yet: (name, line).
    let mut pending: Option<(String, usize)> = None;
    let (mut i, mut line, mut depth, mut nest) = (0, 1, 0usize, 0usize);
    // Moves `i` to `end`, counting the lines passed.
    let skip_to = |i: &mut usize, line: &mut usize, end: usize| {
        let end = end.min(bytes.len());
        *line += text[*i..end].matches('\n').count();
        *i = end;
    };
    while i < bytes.len() {
        let rest = &bytes[i..];
        let boundary = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        let raw_hashes = rest[1..].iter().take_while(|b| **b == b'#').count();
        if rest.starts_with(b"//") {
            let end = rest.iter().position(|b| *b == b'\n').map_or(bytes.len(), |n| i + n);
            skip_to(&mut i, &mut line, end);
        } else if rest.starts_with(b"/*") {
            let end = text[i + 2..].find("*/").map_or(bytes.len(), |n| i + n + 4);
            skip_to(&mut i, &mut line, end);
        } else if boundary && rest[0] == b'r' && rest.get(1 + raw_hashes) == Some(&b'"') {
            let close = format!("\"{}", "#".repeat(raw_hashes));
            let from = i + 2 + raw_hashes;
            let end = text[from..].find(&close).map_or(bytes.len(), |n| from + n + close.len());
            skip_to(&mut i, &mut line, end);
        } else if rest[0] == b'"' {
            let mut j = i + 1;
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            skip_to(&mut i, &mut line, j + 1);
        } else if rest[0] == b'\'' && rest.get(1) == Some(&b'\\') {
            // An escaped character: '\n', '\'', '\u{7b}'.
            let end = rest[2..].iter().position(|b| *b == b'\'').map_or(bytes.len(), |n| i + n + 3);
            skip_to(&mut i, &mut line, end);
        } else if rest[0] == b'\'' && rest.get(2) == Some(&b'\'') {
            i += 3;
        } else if boundary && rest.starts_with(b"fn ") {
            let from = i + 3;
            let end = bytes[from..]
                .iter()
                .position(|b| !(b.is_ascii_alphanumeric() || *b == b'_'))
                .map_or(bytes.len(), |n| from + n);
            if end > from {
                pending = Some((text[from..end].to_owned(), line));
            }
            i = end;
        } else {
            match rest[0] {
                b'\n' => line += 1,
                b'(' | b'[' => nest += 1,
                b')' | b']' => nest = nest.saturating_sub(1),
                // A declaration without a body (a trait's method).
                b';' if nest == 0 => pending = None,
                b'{' => {
                    depth += 1;
                    if let Some((name, first)) = pending.take() {
                        open.push((name, first, depth));
                    }
                }
                b'}' => {
                    if open.last().is_some_and(|o| o.2 == depth) {
                        let (name, first, _) = open.pop().expect("an open body");
                        found.push((name, first, line - first + 1));
                    }
                    depth = depth.saturating_sub(1);
                }
                _ => {}
            }
            i += 1;
        }
    }
    found
}

#[test]
fn the_function_scan_measures_bodies_not_what_is_inside_strings() {
    let text = "fn a() {\n    let s = \"}}{\";\n    let c = '}';\n    // }\n}\n\
                trait T {\n    fn b(&self, x: [u8; 2]);\n}\n\
                fn c<'a>(x: &'a str) -> impl Fn() {\n    let r = r#\"{\"#;\n    move || {}\n}\n\
                fn d() { let e = '\\''; /* { */ }\n";
    assert_eq!(
        function_lengths(text),
        [("a".to_owned(), 1, 5), ("c".to_owned(), 9, 4), ("d".to_owned(), 13, 1)],
        "{text}"
    );
}

#[test]
fn no_function_of_the_processor_is_longer_than_80_lines() {
    // A function a reader takes in at once: past it, the parts are functions with names.
    let mut long = Vec::new();
    for (file, text) in sources(&root().join("processor/src")) {
        for (name, first, lines) in function_lengths(&text) {
            if lines > 80 {
                long.push(format!("processor/src/{file}:{first} {name}: {lines} lines"));
            }
        }
    }
    assert!(long.is_empty(), "functions over 80 lines:\n{}", long.join("\n"));
}

#[test]
fn every_task_the_processor_starts_is_owned_and_joined() {
    // A task spawned bare is waited for by nobody: a stop does not wait for it, and its death
    // goes unnoticed. The processor starts tasks through supervise::{Tasks, Work}, or a
    // JoinSet its owner joins; blocking work (spawn_blocking) is awaited where it starts.
    let bare = ["tokio::spawn(", "task::spawn(", "thread::spawn("];
    let mut found = Vec::new();
    for (file, text) in sources(&root().join("processor/src")) {
        // Unit tests may spawn as they like.
        let product = text.split("#[cfg(test)]").next().unwrap_or_default();
        for (n, line) in product.lines().enumerate() {
            let code = !line.trim_start().starts_with("//");
            if code && bare.iter().any(|b| line.contains(b)) {
                found.push(format!("processor/src/{file}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "tasks spawned bare:\n{}", found.join("\n"));
}

#[test]
fn the_consumer_is_polled_only_on_a_thread_of_its_own() {
    // Its rebalance callbacks run inside its poll and block it (the revoke waits for the
    // partition's jobs, then commits synchronously): polled on a tokio worker, they would
    // stall every task scheduled there. So the poll is in `consume`, and `consume` runs only
    // inside spawn_blocking (worker/consumer.rs).
    let text = std::fs::read_to_string(root().join("processor/src/worker/consumer.rs")).unwrap();
    let (_, first, lines) = function_lengths(&text)
        .into_iter()
        .find(|(name, _, _)| name == "consume")
        .expect("worker::consume");
    let body = first..first + lines;
    let mut polls = Vec::new();
    let mut calls = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim_start().starts_with("//")) {
        if line.contains("consumer.poll(") {
            polls.push(n + 1);
        }
        if line.contains("consume(&") {
            calls.push((n + 1, line.contains("spawn_blocking(")));
        }
    }
    assert!(!polls.is_empty(), "worker/consumer.rs polls its consumer nowhere");
    let outside: Vec<usize> = polls.into_iter().filter(|n| !body.contains(n)).collect();
    assert!(outside.is_empty(), "the consumer is polled outside `consume`: lines {outside:?}");
    assert!(!calls.is_empty(), "`consume` is called nowhere");
    let on_workers: Vec<usize> = calls.iter().filter(|c| !c.1).map(|c| c.0).collect();
    assert!(on_workers.is_empty(), "`consume` runs outside spawn_blocking: lines {on_workers:?}");
}

#[test]
fn every_end_to_end_test_file_is_a_module_of_the_suite() {
    // With `autotests = false` (tests/Cargo.toml) Cargo no longer finds the files under
    // tests/tests by itself: one missing from main.rs would compile into nothing and run never.
    let dir = root().join("tests/tests");
    let main = std::fs::read_to_string(dir.join("main.rs")).unwrap();
    let declared: BTreeSet<&str> =
        code(&main).filter_map(|l| l.trim().strip_prefix("mod ")?.strip_suffix(';')).collect();
    let files: BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .filter(|stem| stem != "main")
        .collect();
    assert!(files.len() > 1, "tests/tests holds no test files: {files:?}");
    let missing: Vec<&String> = files.iter().filter(|f| !declared.contains(f.as_str())).collect();
    assert!(missing.is_empty(), "test files tests/tests/main.rs leaves out: {missing:?}");
}
