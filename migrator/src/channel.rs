//! A framed message stream over any byte stream: the daemon's API and the peer
//! migrators' exchanges both ride on it.
//!
//! Every message travels in rdmamig-proto's frames (magic, version, length, JSON; 64 KiB at
//! most): one frame when it fits, otherwise a run of pieces ([`rdmamig_proto::message`]). A
//! receiver bounds what it assembles (one frame unless told otherwise), so a peer cannot make
//! it hold more than it agreed to.

use rdmamig_proto::message::{self, Assembler, MessageError};
use rdmamig_proto::{Frame, FrameBuffer, FrameError, MAX_FRAME_LEN};
use serde::de::DeserializeOwned;
use serde::Serialize;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub use rdmamig_proto::message::MAX_MESSAGE_LEN;

/// Why a message could not be sent or received.
#[derive(Debug, Error)]
pub enum ChannelError {
    /// Writing failed.
    #[error("cannot send a message")]
    Send(#[source] std::io::Error),
    /// Reading failed.
    #[error("cannot receive a message")]
    Receive(#[source] std::io::Error),
    /// The peer closed the connection before a whole message arrived.
    #[error("the peer closed the connection")]
    Closed,
    /// The bytes are not a message.
    #[error("malformed message")]
    Malformed(#[source] FrameError),
    /// A message is larger than the receiver takes.
    #[error("a message of {len} bytes or more is larger than the limit of {limit} bytes")]
    TooLarge {
        /// Its encoded size (so far, for one being received).
        len: usize,
        /// The limit.
        limit: usize,
    },
}

impl From<MessageError> for ChannelError {
    fn from(e: MessageError) -> Self {
        match e {
            MessageError::TooLarge { len, limit } => ChannelError::TooLarge { len, limit },
            MessageError::Malformed(e) => ChannelError::Malformed(e),
        }
    }
}

/// A framed message stream over any byte stream.
pub struct Channel<S> {
    stream: S,
    buffer: FrameBuffer,
    /// Assembles messages up to the limit [`Channel::receive`] takes.
    assembler: Assembler,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Channel<S> {
    /// Wraps a connected stream; it receives messages of one frame at most.
    pub fn new(stream: S) -> Channel<S> {
        Channel::with_receive_limit(stream, MAX_FRAME_LEN)
    }

    /// Wraps a connected stream that receives messages of up to `limit` bytes (at most
    /// [`MAX_MESSAGE_LEN`]).
    pub fn with_receive_limit(stream: S, limit: usize) -> Channel<S> {
        Channel {
            stream,
            buffer: FrameBuffer::new(),
            assembler: Assembler::new(limit),
        }
    }

    /// Sends one message: in one frame if it fits, in pieces otherwise, up to
    /// [`MAX_MESSAGE_LEN`].
    pub async fn send<T: Serialize>(&mut self, message: &T) -> Result<(), ChannelError> {
        let bytes = message::encode(message)?;
        self.stream
            .write_all(&bytes)
            .await
            .map_err(ChannelError::Send)
    }

    /// Receives one message. `Ok(None)` when the peer closed cleanly between messages. A
    /// message past the limit is an error once; the channel then carries on with the next.
    pub async fn receive<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ChannelError> {
        loop {
            let Some(frame) = self.next_frame(self.assembler.is_assembling()).await? else {
                return Ok(None);
            };
            if let Some(message) = self.assembler.take(frame)? {
                return Ok(Some(message));
            }
        }
    }

    /// The next whole frame; `None` when the peer closed cleanly between frames and
    /// `within` is false (no message was under way).
    async fn next_frame(&mut self, within: bool) -> Result<Option<Frame>, ChannelError> {
        let mut chunk = [0u8; 8192];
        loop {
            match self.buffer.pop() {
                Ok(frame) => return Ok(Some(frame)),
                Err(FrameError::Incomplete { .. }) => {}
                Err(e) => return Err(ChannelError::Malformed(e)),
            }
            let n = self
                .stream
                .read(&mut chunk)
                .await
                .map_err(ChannelError::Receive)?;
            if n == 0 {
                return if self.buffer.is_empty() && !within {
                    Ok(None)
                } else {
                    Err(ChannelError::Closed)
                };
            }
            self.buffer.push(&chunk[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    /// A message of the tests' own.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Note {
        reason: String,
    }

    #[tokio::test]
    async fn messages_cross_a_stream_and_limits_hold() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (mut a, mut b) = (Channel::new(a), Channel::new(b));
        let message = Note {
            reason: "busy".into(),
        };
        a.send(&message).await.unwrap();
        assert_eq!(b.receive::<Note>().await.unwrap(), Some(message));

        let huge = Note {
            reason: "x".repeat(MAX_MESSAGE_LEN),
        };
        assert!(matches!(
            a.send(&huge).await,
            Err(ChannelError::TooLarge { .. })
        ));

        a.send(&"not a note").await.unwrap();
        assert!(matches!(
            b.receive::<Note>().await,
            Err(ChannelError::Malformed(FrameError::Malformed { .. }))
        ));
        drop(a);
        assert!(b.receive::<Note>().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_message_larger_than_a_frame_goes_in_pieces_and_the_receiver_bounds_it() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (mut daemon, mut client) = (
            Channel::new(a),
            Channel::with_receive_limit(b, MAX_MESSAGE_LEN),
        );
        // Quotes and backslashes double when a piece escapes them; a multi-byte character
        // must not be cut.
        let reason: String = "\"\\é".repeat(100_000);
        let message = Note { reason };
        let writer = tokio::spawn(async move {
            daemon.send(&message).await.unwrap();
            daemon
                .send(&Note {
                    reason: "next".into(),
                })
                .await
                .unwrap();
            (daemon, message)
        });
        let received = client.receive::<Note>().await.unwrap().unwrap();
        let next = client.receive::<Note>().await.unwrap().unwrap();
        let (mut daemon, message) = writer.await.unwrap();
        assert_eq!(received, message);
        assert_eq!(
            next,
            Note {
                reason: "next".into()
            }
        );
        // The daemon's side takes requests of one frame only.
        client.send(&message).await.unwrap();
        assert!(matches!(
            daemon.receive::<Note>().await,
            Err(ChannelError::TooLarge {
                limit: MAX_FRAME_LEN,
                ..
            })
        ));
    }

    #[tokio::test]
    async fn a_cut_message_is_an_error() {
        let (a, b) = tokio::io::duplex(1024);
        let mut b = Channel::new(b);
        let bytes = Frame::encode(&Note { reason: "x".into() });
        let mut a = a;
        a.write_all(&bytes[..bytes.len() - 1]).await.unwrap();
        drop(a);
        assert!(matches!(
            b.receive::<Note>().await,
            Err(ChannelError::Closed)
        ));
    }
}
