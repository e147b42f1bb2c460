//! The protobuf codec of rota's services. It differs from tonic-prost's only
//! in how a message that does not parse is answered: INVALID_ARGUMENT (the
//! client sent a malformed request) instead of INTERNAL.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::ProstEncoder;

#[derive(Debug, Clone)]
pub struct StrictCodec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for StrictCodec<T, U> {
    fn default() -> Self {
        Self { _types: PhantomData }
    }
}

impl<T, U> Codec for StrictCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = StrictDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        StrictDecoder { _type: PhantomData }
    }
}

#[derive(Debug, Clone)]
pub struct StrictDecoder<U> {
    _type: PhantomData<U>,
}

impl<U: Message + Default> Decoder for StrictDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf).map(Some).map_err(|e| Status::invalid_argument(format!("malformed request: {e}")))
    }
}
