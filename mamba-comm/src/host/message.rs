//! What travels between host-transport ranks, and its wire form.
//!
//! Threads exchange [`Event`]s through channels as Rust values; processes
//! exchange the same events serialised by [`encode`] and read back by
//! [`decode`]. f32 and i32 values travel as little-endian bit patterns, so a
//! value arrives bit-identical (NaN payloads and signed zeros included).

use std::io::{self, Read};

/// Which operation a message belongs to. Every receive names the code it
/// expects, so ranks that call different collectives (or the same one with
/// different sizes) get a clear error instead of silently mixing data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpCode {
    /// Point-to-point `send`/`recv`.
    P2p = 1,
    /// `broadcast` from the root.
    Broadcast = 2,
    /// A contribution to `all_reduce_sum_f32`, sent to the leader (rank 0).
    SumGather = 3,
    /// The reduced sum, sent by the leader to every rank.
    SumResult = 4,
    /// A contribution to `all_reduce_max_i32`.
    MaxGather = 5,
    /// The reduced max.
    MaxResult = 6,
    /// "I have entered the barrier", sent to the leader.
    BarrierArrive = 7,
    /// "Everyone has entered", sent by the leader.
    BarrierRelease = 8,
}

impl OpCode {
    fn from_u8(v: u8) -> Option<OpCode> {
        Some(match v {
            1 => OpCode::P2p,
            2 => OpCode::Broadcast,
            3 => OpCode::SumGather,
            4 => OpCode::SumResult,
            5 => OpCode::MaxGather,
            6 => OpCode::MaxResult,
            7 => OpCode::BarrierArrive,
            8 => OpCode::BarrierRelease,
            _ => return None,
        })
    }

    /// Human name used in mismatch errors.
    pub(crate) fn name(self) -> &'static str {
        match self {
            OpCode::P2p => "send/recv",
            OpCode::Broadcast => "broadcast",
            OpCode::SumGather | OpCode::SumResult => "all_reduce_sum_f32",
            OpCode::MaxGather | OpCode::MaxResult => "all_reduce_max_i32",
            OpCode::BarrierArrive | OpCode::BarrierRelease => "barrier",
        }
    }
}

/// The values a message carries.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Payload {
    /// No values (barrier tokens).
    Empty,
    /// f32 values (bit patterns preserved).
    F32(Vec<f32>),
    /// i32 values.
    I32(Vec<i32>),
}

impl Payload {
    /// Number of values carried.
    pub(crate) fn len(&self) -> usize {
        match self {
            Payload::Empty => 0,
            Payload::F32(v) => v.len(),
            Payload::I32(v) => v.len(),
        }
    }
}

/// One data message: an operation code and its values.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Msg {
    pub(crate) op: OpCode,
    pub(crate) payload: Payload,
}

/// What arrives in a rank's inbox. `from` is always the peer the event is
/// about (for sockets: the peer at the other end of the connection it came
/// through, never a value read from the wire).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Event {
    /// A data message.
    Msg { from: usize, msg: Msg },
    /// The peer is leaving in order: it will send nothing more. Only an error
    /// if this rank still waits for something from it.
    Bye { from: usize },
    /// The peer hit an error that names `culprit` and is tearing down.
    Abort {
        from: usize,
        culprit: usize,
        detail: String,
    },
    /// The connection to the peer broke (socket closed without a goodbye,
    /// write failed). Always an error: the peer died or the network failed.
    Closed { from: usize, detail: String },
    /// The link's reader refused a frame from the peer before reading its
    /// payload (it claimed more values than the receive it belongs to
    /// expects) and stopped reading. Always an error naming the peer.
    Refused { from: usize, detail: String },
}

const TAG_MSG: u8 = 1;
const TAG_BYE: u8 = 2;
const TAG_ABORT: u8 = 3;

const PAYLOAD_EMPTY: u8 = 0;
const PAYLOAD_F32: u8 = 1;
const PAYLOAD_I32: u8 = 2;

/// Bytes read per piece of a frame's payload: memory grows with what the
/// peer actually sent, never with what its header claims.
const READ_PIECE: usize = 1 << 20;
/// Largest abort detail accepted, in bytes.
const MAX_DETAIL: u32 = 1 << 16;

/// Exactly `len` bytes from `r`, in pieces of at most [`READ_PIECE`].
fn read_pieces(r: &mut impl Read, len: usize) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::with_capacity(len.min(READ_PIECE));
    while bytes.len() < len {
        let start = bytes.len();
        let n = (len - start).min(READ_PIECE);
        bytes.resize(start + n, 0);
        r.read_exact(&mut bytes[start..])?;
    }
    Ok(bytes)
}

/// Serialise an event sent by this rank. `Closed` and `Refused` are never
/// sent (they are produced locally by a link's reader) and encode to
/// nothing.
///
/// Layout: `tag u8`, then for `Msg`: `op u8, payload kind u8, count u64 LE,
/// values LE`; for `Abort`: `culprit u32 LE, detail len u32 LE, utf-8`;
/// for `Bye`: nothing.
pub(crate) fn encode(event: &Event, out: &mut Vec<u8>) {
    match event {
        Event::Msg { msg, .. } => {
            out.push(TAG_MSG);
            out.push(msg.op as u8);
            match &msg.payload {
                Payload::Empty => {
                    out.push(PAYLOAD_EMPTY);
                    out.extend_from_slice(&0u64.to_le_bytes());
                }
                Payload::F32(v) => {
                    out.push(PAYLOAD_F32);
                    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                    out.reserve(v.len() * 4);
                    for x in v {
                        out.extend_from_slice(&x.to_bits().to_le_bytes());
                    }
                }
                Payload::I32(v) => {
                    out.push(PAYLOAD_I32);
                    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                    out.reserve(v.len() * 4);
                    for x in v {
                        out.extend_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }
        Event::Bye { .. } => out.push(TAG_BYE),
        Event::Abort {
            culprit, detail, ..
        } => {
            out.push(TAG_ABORT);
            let culprit = u32::try_from(*culprit).unwrap_or(u32::MAX);
            out.extend_from_slice(&culprit.to_le_bytes());
            let bytes = detail.as_bytes();
            let n = bytes.len().min(MAX_DETAIL as usize);
            out.extend_from_slice(&(n as u32).to_le_bytes());
            out.extend_from_slice(&bytes[..n]);
        }
        Event::Closed { .. } | Event::Refused { .. } => {}
    }
}

fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn bad(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// Read one event sent by peer `from`, admitting every data frame: see
/// [`decode_gated`].
#[cfg(test)]
pub(crate) fn decode(
    r: &mut impl Read,
    from: usize,
    max_values: usize,
) -> io::Result<Option<Event>> {
    decode_gated(r, from, max_values, &mut |_, _| None)
}

/// Read one event sent by peer `from`. `Ok(None)` is a clean end of stream
/// at a frame boundary; a stream that ends inside a frame is an error.
///
/// A frame claiming more than `max_values` values (the receiver's bound,
/// [`HostOptions::max_values`](super::HostOptions::max_values)) is refused
/// before any of it is read, and the payload is read in pieces, so a peer
/// that lies about a length makes this rank allocate only what it sent.
///
/// Every data frame's header (operation, claimed count) is shown to `admit`
/// before its payload is read; when `admit` answers `Some(detail)` the
/// payload is not read and the result is [`Event::Refused`] with that
/// detail (the stream is then inside a frame: read no further).
pub(crate) fn decode_gated(
    r: &mut impl Read,
    from: usize,
    max_values: usize,
    admit: &mut dyn FnMut(OpCode, u64) -> Option<String>,
) -> io::Result<Option<Event>> {
    let mut tag = [0u8; 1];
    loop {
        match r.read(&mut tag) {
            Ok(0) => return Ok(None),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    match tag[0] {
        TAG_MSG => {
            let op_raw = read_u8(r)?;
            let op = OpCode::from_u8(op_raw)
                .ok_or_else(|| bad(format!("unknown operation code {op_raw}")))?;
            let kind = read_u8(r)?;
            let count = read_u64(r)?;
            if count > max_values as u64 {
                return Err(bad(format!(
                    "a frame claims {count} values, more than this rank ever receives \
                     ({max_values}, HostOptions::max_values): the ranks run different \
                     programs, or the peer does not speak this protocol"
                )));
            }
            if let Some(detail) = admit(op, count) {
                return Ok(Some(Event::Refused { from, detail }));
            }
            let count = count as usize;
            let payload = match kind {
                PAYLOAD_EMPTY if count == 0 => Payload::Empty,
                PAYLOAD_F32 | PAYLOAD_I32 => {
                    let bytes = read_pieces(r, count * 4)?;
                    let words = bytes.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]);
                    if kind == PAYLOAD_F32 {
                        Payload::F32(
                            words
                                .map(|w| f32::from_bits(u32::from_le_bytes(w)))
                                .collect(),
                        )
                    } else {
                        Payload::I32(words.map(i32::from_le_bytes).collect())
                    }
                }
                other => {
                    return Err(bad(format!("bad payload kind {other} with {count} values")));
                }
            };
            Ok(Some(Event::Msg {
                from,
                msg: Msg { op, payload },
            }))
        }
        TAG_BYE => Ok(Some(Event::Bye { from })),
        TAG_ABORT => {
            let culprit = read_u32(r)? as usize;
            let n = read_u32(r)?;
            if n > MAX_DETAIL {
                return Err(bad(format!(
                    "abort detail of {n} bytes (limit {MAX_DETAIL})"
                )));
            }
            let mut bytes = vec![0u8; n as usize];
            r.read_exact(&mut bytes)?;
            Ok(Some(Event::Abort {
                from,
                culprit,
                detail: String::from_utf8_lossy(&bytes).into_owned(),
            }))
        }
        other => Err(bad(format!("unknown frame tag {other}"))),
    }
}

/// An element type the host transport carries: how a vector of it travels
/// in a [`Payload`], and its name in size-mismatch errors.
pub(crate) trait Wire: Copy {
    const KIND: &'static str;
    fn payload(v: Vec<Self>) -> Payload;
    /// The values of `p` if it carries this type, else `p` back.
    fn values(p: Payload) -> std::result::Result<Vec<Self>, Payload>;
}

/// `impl Wire` for an element type carried by the `Payload` variant named.
macro_rules! wire {
    ($t:ty, $variant:ident) => {
        impl Wire for $t {
            const KIND: &'static str = stringify!($t);
            fn payload(v: Vec<$t>) -> Payload {
                Payload::$variant(v)
            }
            fn values(p: Payload) -> std::result::Result<Vec<$t>, Payload> {
                match p {
                    Payload::$variant(v) => Ok(v),
                    other => Err(other),
                }
            }
        }
    };
}

wire!(f32, F32);
wire!(i32, I32);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(e: &Event) -> Event {
        let mut buf = Vec::new();
        encode(e, &mut buf);
        let mut r = &buf[..];
        let back = decode(&mut r, 3, usize::MAX)
            .expect("decode")
            .expect("one event");
        assert!(r.is_empty(), "decoder left {} bytes", r.len());
        back
    }

    proptest! {
        #[test]
        fn f32_bits_survive_the_wire(bits in proptest::collection::vec(any::<u32>(), 0..64)) {
            let v: Vec<f32> = bits.iter().map(|b| f32::from_bits(*b)).collect();
            let e = Event::Msg { from: 3, msg: Msg { op: OpCode::SumGather, payload: Payload::F32(v) } };
            match roundtrip(&e) {
                Event::Msg { from, msg } => {
                    prop_assert_eq!(from, 3);
                    prop_assert_eq!(msg.op, OpCode::SumGather);
                    match msg.payload {
                        Payload::F32(got) => {
                            let got: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                            prop_assert_eq!(got, bits);
                        }
                        other => prop_assert!(false, "wrong payload {:?}", other),
                    }
                }
                other => prop_assert!(false, "wrong event {:?}", other),
            }
        }

        #[test]
        fn i32_values_survive_the_wire(v in proptest::collection::vec(any::<i32>(), 0..64)) {
            let e = Event::Msg { from: 3, msg: Msg { op: OpCode::MaxGather, payload: Payload::I32(v) } };
            prop_assert_eq!(roundtrip(&e), e);
        }
    }

    #[test]
    fn control_frames_roundtrip() {
        for e in [
            Event::Bye { from: 3 },
            Event::Abort {
                from: 3,
                culprit: 7,
                detail: "rank 7 stopped answering".into(),
            },
            Event::Msg {
                from: 3,
                msg: Msg {
                    op: OpCode::BarrierArrive,
                    payload: Payload::Empty,
                },
            },
        ] {
            assert_eq!(roundtrip(&e), e);
        }
    }

    #[test]
    fn truncated_frame_is_an_error_not_a_clean_end() {
        let e = Event::Msg {
            from: 0,
            msg: Msg {
                op: OpCode::P2p,
                payload: Payload::F32(vec![1.0; 8]),
            },
        };
        let mut buf = Vec::new();
        encode(&e, &mut buf);
        buf.truncate(buf.len() - 3);
        let mut r = &buf[..];
        assert!(decode(&mut r, 0, usize::MAX).is_err());
        // A stream that ends between frames is a clean end.
        let mut empty: &[u8] = &[];
        assert!(decode(&mut empty, 0, usize::MAX).expect("clean").is_none());
    }

    #[test]
    fn absurd_lengths_and_tags_are_rejected() {
        // More than the receiver's bound: refused, naming the bound.
        let mut buf = vec![TAG_MSG, OpCode::P2p as u8, PAYLOAD_F32];
        buf.extend_from_slice(&1001u64.to_le_bytes());
        buf.extend(std::iter::repeat_n(0u8, 1001 * 4));
        let e = decode(&mut &buf[..], 0, 1000).unwrap_err().to_string();
        assert!(e.contains("1001 values") && e.contains("1000"), "{e}");
        // Control: at the bound it is read.
        assert!(decode(&mut &buf[..], 0, 1001).unwrap().is_some());
        // A header that lies (2^40 values = 4 TiB) with no bound: the
        // payload is read in pieces, so the stream's end is an error, not
        // an allocation of what the header claims (which aborted before).
        let mut buf = vec![TAG_MSG, OpCode::P2p as u8, PAYLOAD_F32];
        buf.extend_from_slice(&(1u64 << 40).to_le_bytes());
        buf.extend_from_slice(&[0u8; 64]);
        assert!(decode(&mut &buf[..], 0, usize::MAX).is_err());
        assert!(decode(&mut &[99u8][..], 0, usize::MAX).is_err());
        let mut buf = vec![TAG_MSG, 42, PAYLOAD_EMPTY];
        buf.extend_from_slice(&0u64.to_le_bytes());
        assert!(decode(&mut &buf[..], 0, usize::MAX).is_err());
    }
}
