//! A Postgres primary with a synchronous standby of a test's own (`docker/postgres.sh` with
//! `JOBFOLD_PG_NODES=2`, on free ports and a state directory of its own), and the faults
//! the scripts strike it with: failover, switchover, a node killed, a node rejoined.

use std::path::{Path, PathBuf};

/// A running pair; stopped and removed on drop.
#[derive(Debug)]
pub struct Pair {
    script: Script,
}

/// `docker/postgres.sh` with the pair's variables.
#[derive(Debug, Clone)]
struct Script {
    root: PathBuf,
    env: Vec<(String, String)>,
}

impl Script {
    fn run(&self, args: &[&str]) -> String {
        let output = std::process::Command::new("bash")
            .arg(self.root.join("docker/postgres.sh"))
            .args(args)
            .envs(self.env.iter().cloned())
            .stdin(std::process::Stdio::null())
            .output()
            .expect("running docker/postgres.sh");
        let out = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "docker/postgres.sh {} failed: {out}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
        out
    }
}

impl Pair {
    /// Starts a pair on free ports: node n on `base + 10n`.
    ///
    /// # Panics
    /// The script failed.
    pub fn start(name: &str) -> Self {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let base = loop {
            let base = crate::harness::free_port().saturating_sub(20);
            if (1..=2).all(|n| std::net::TcpListener::bind(("127.0.0.1", base + 10 * n)).is_ok()) {
                break base;
            }
        };
        let state = std::env::temp_dir()
            .join(format!("jobfold-pair-{name}-{}", uuid::Uuid::new_v4().simple()));
        let env = vec![
            ("JOBFOLD_STATE_DIR".into(), state.display().to_string()),
            ("JOBFOLD_PG_PORT".into(), base.to_string()),
            ("JOBFOLD_PG_NODES".into(), "2".into()),
        ];
        let pair = Self { script: Script { root, env } };
        pair.script(&["start"]);
        pair
    }

    /// `docker/postgres.sh args...`; its standard output.
    ///
    /// # Panics
    /// The script failed.
    pub fn script(&self, args: &[&str]) -> String {
        self.script.run(args)
    }

    /// [`Pair::script`] without holding a runtime thread.
    pub async fn run(&self, args: &[&str]) -> String {
        let script = self.script.clone();
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        tokio::task::spawn_blocking(move || {
            script.run(&args.iter().map(String::as_str).collect::<Vec<_>>())
        })
        .await
        .expect("the script's thread")
    }

    /// A shell command running `docker/postgres.sh args...` on this pair (for a program
    /// that runs it, as `jobfold bench --failover`).
    pub fn command(&self, args: &[&str]) -> String {
        let vars: Vec<String> = self.script.env.iter().map(|(k, v)| format!("{k}='{v}'")).collect();
        let script = self.script.root.join("docker/postgres.sh");
        format!("{} bash '{}' {}", vars.join(" "), script.display(), args.join(" "))
    }

    /// The URL naming both hosts, with `database`.
    pub fn url(&self, database: &str) -> String {
        let url = self.script(&["url"]);
        let (hosts, _) = url.trim().rsplit_once('/').expect("a URL with a database");
        format!("{hosts}/{database}?target_session_attrs=read-write")
    }

    /// The node (1 or 2) that is primary now.
    pub fn primary(&self) -> u8 {
        self.script(&["primary"]).trim().parse().expect("a node number")
    }

    /// A URL of the primary alone (the `jobfold` role), with `database`.
    pub fn primary_url(&self, database: &str) -> String {
        let base: u16 = self.script.env[1].1.parse().expect("a port");
        let port = base + 10 * u16::from(self.primary());
        format!("postgres://jobfold:jobfold@127.0.0.1:{port}/{database}")
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let s = &self.script;
        let _ = std::process::Command::new("bash")
            .arg(s.root.join("docker/postgres.sh"))
            .arg("stop")
            .envs(s.env.iter().cloned())
            .stdin(std::process::Stdio::null())
            .output();
        let _ = std::fs::remove_dir_all(&s.env[0].1);
    }
}
