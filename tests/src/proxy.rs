//! A TCP proxy that cuts idle connections, as a load balancer does, and counts them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What a proxy saw.
#[derive(Debug, Default)]
pub struct Counts {
    /// Connections accepted.
    pub accepted: AtomicUsize,
    /// Connections cut for being idle.
    pub cut: AtomicUsize,
}

impl Counts {
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    pub fn cut(&self) -> usize {
        self.cut.load(Ordering::SeqCst)
    }
}

/// A TCP proxy on 127.0.0.1 to `target` that closes a connection idle (no byte either way)
/// for `idle`; its address and what it counted.
pub async fn idle_proxy(target: SocketAddr, idle: Duration) -> (SocketAddr, Arc<Counts>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let counts = Arc::new(Counts::default());
    let counted = Arc::clone(&counts);
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            counted.accepted.fetch_add(1, Ordering::SeqCst);
            let counts = Arc::clone(&counted);
            tokio::spawn(async move {
                let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                let (mut a, mut b) = ([0u8; 16384], [0u8; 16384]);
                loop {
                    tokio::select! {
                        read = inbound.read(&mut a) => match read {
                            Ok(n) if n > 0 => if outbound.write_all(&a[..n]).await.is_err() { return },
                            _ => return,
                        },
                        read = outbound.read(&mut b) => match read {
                            Ok(n) if n > 0 => if inbound.write_all(&b[..n]).await.is_err() { return },
                            _ => return,
                        },
                        () = tokio::time::sleep(idle) => {
                            counts.cut.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, counts)
}
