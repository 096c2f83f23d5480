//! A TCP proxy that cuts idle connections, as a load balancer does.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A TCP proxy to `target` that closes a connection idle (no byte either way) for `idle`;
/// how many it cut.
pub async fn idle_proxy(target: SocketAddr, idle: Duration) -> (SocketAddr, Arc<Mutex<usize>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cut = Arc::new(Mutex::new(0));
    let counted = Arc::clone(&cut);
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let cut = Arc::clone(&counted);
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
                            *cut.lock().unwrap() += 1;
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, cut)
}
