//! A real headless Chromium driven over WebDriver: the distribution's `chromium` and
//! `chromedriver` (docker/test.sh installs both), and fantoccini as the client.
//!
//! chromedriver runs in a process group of its own, so the browsers it starts end with it
//! even when a test fails half-way.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::actions::{InputSource, KeyAction, KeyActions};
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{Value, json};

use crate::harness::free_port;

/// How long a page may take to show what a test waits for.
const PAGE_WAIT: Duration = Duration::from_secs(45);

/// A headless Chromium session and its chromedriver.
#[derive(Debug)]
pub struct Browser {
    pub client: Client,
    driver: Child,
    shots: PathBuf,
    closed: bool,
}

/// The first of `names` on `PATH`, or the file `variable` names.
fn program(variable: &str, names: &[&str]) -> PathBuf {
    if let Ok(path) = std::env::var(variable) {
        return PathBuf::from(path);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        for name in names {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    panic!(
        "{} is not installed: docker/test.sh installs the chromium and chromium-driver \
         packages (or set {variable})",
        names[0]
    );
}

/// Where the tests write their screenshots: `target/console/`.
pub fn screenshot_dir() -> PathBuf {
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("console")
}

impl Browser {
    /// Starts chromedriver and a headless Chromium with a window of `width` × `height`.
    pub async fn start(width: u32, height: u32) -> Self {
        use std::os::unix::process::CommandExt;
        let chromium = program("JOBFOLD_CHROMIUM", &["chromium", "chromium-browser"]);
        let chromedriver = program("JOBFOLD_CHROMEDRIVER", &["chromedriver"]);
        let shots = screenshot_dir();
        std::fs::create_dir_all(&shots).unwrap();
        let port = free_port();
        let log = std::fs::File::create(shots.join(format!("chromedriver-{port}.log"))).unwrap();
        let driver = Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", chromedriver.display()));
        let url = format!("http://127.0.0.1:{port}");
        let profile = std::env::temp_dir().join(format!("jobfold-chromium-{port}"));
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("browserName".into(), json!("chrome"));
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": chromium,
                "args": [
                    "--headless=new",
                    // Tests run as root, where Chromium's sandbox cannot start.
                    "--no-sandbox",
                    "--disable-dev-shm-usage",
                    "--disable-gpu",
                    "--hide-scrollbars",
                    format!("--window-size={width},{height}"),
                    format!("--user-data-dir={}", profile.display()),
                ],
            }),
        );
        let started = Instant::now();
        let client = loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match ClientBuilder::new(connector)
                .capabilities(capabilities.clone())
                .connect(&url)
                .await
            {
                Ok(client) => break client,
                Err(e) if started.elapsed() < Duration::from_secs(30) => {
                    tracing::debug!("chromedriver not ready: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("no browser session from {}: {e}", chromedriver.display()),
            }
        };
        Self { client, driver, shots, closed: false }
    }

    /// Opens `url`.
    pub async fn goto(&self, url: &str) {
        self.client.goto(url).await.unwrap();
    }

    /// Runs `script` (a function body) and returns its value.
    pub async fn js(&self, script: &str) -> Value {
        self.client.execute(script, Vec::new()).await.unwrap()
    }

    /// Runs `script` until it returns something other than `null`, `false` or `""`, and
    /// returns that; fails after a while naming `what`.
    pub async fn until(&self, what: &str, script: &str) -> Value {
        let started = Instant::now();
        loop {
            let value = self.client.execute(script, Vec::new()).await.unwrap_or(Value::Null);
            if !matches!(&value, Value::Null | Value::Bool(false)) && value != json!("") {
                return value;
            }
            assert!(started.elapsed() < PAGE_WAIT, "the page did not show {what} in time");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The text of the first element matching `css`, once there is one.
    pub async fn text(&self, css: &str) -> String {
        let element =
            self.client.wait().at_most(PAGE_WAIT).for_element(Locator::Css(css)).await.unwrap();
        element.text().await.unwrap()
    }

    /// Clicks the first element matching `css`, once there is one.
    pub async fn click(&self, css: &str) {
        let element =
            self.client.wait().at_most(PAGE_WAIT).for_element(Locator::Css(css)).await.unwrap();
        element.click().await.unwrap_or_else(|e| panic!("clicking {css}: {e}"));
    }

    /// Types `text` into the first element matching `css`, replacing what it held.
    pub async fn fill(&self, css: &str, text: &str) {
        let element =
            self.client.wait().at_most(PAGE_WAIT).for_element(Locator::Css(css)).await.unwrap();
        element.clear().await.unwrap();
        element.send_keys(text).await.unwrap();
    }

    /// Presses `key` (a [`fantoccini::key::Key`] as a char, or a character) on the keyboard.
    pub async fn press(&self, key: char) {
        let actions = KeyActions::new("keyboard".into())
            .then(KeyAction::Down { value: key })
            .then(KeyAction::Up { value: key });
        self.client.perform_actions(actions).await.unwrap();
    }

    /// The page has no horizontal scroll: nothing is wider than the window.
    pub async fn fits_width(&self) -> bool {
        self.js("return document.documentElement.scrollWidth <= window.innerWidth;").await
            == json!(true)
    }

    /// Saves the window as `target/console/<name>.png`; returns the path.
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let png = self.client.screenshot().await.unwrap();
        assert!(png.starts_with(b"\x89PNG"), "the screenshot is not a PNG");
        let path = self.shots.join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        path
    }

    /// Ends the session (Chromium exits) and chromedriver.
    pub async fn close(mut self) {
        let _ = self.client.clone().close().await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        self.closed = true;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        // The whole group: chromedriver and the browsers it started.
        let _ = Command::new("kill").args(["-9", "--", &format!("-{}", self.driver.id())]).status();
        let _ = self.driver.wait();
    }
}
