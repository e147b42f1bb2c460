//! Just enough DER to read what rota needs from an X.509 certificate: its
//! serial number and the URIs among its subject alternative names. Pure;
//! every read is bounded by the input.

/// What rota reads from a certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateFacts {
    /// The serial number's bytes, as encoded (big-endian, maybe a leading 0).
    pub serial: Vec<u8>,
    /// URI entries of the subjectAltName extension, in order.
    pub uris: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed certificate: {0}")]
pub struct DerError(pub &'static str);

const SEQUENCE: u8 = 0x30;
const INTEGER: u8 = 0x02;
const OID: u8 = 0x06;
const BOOLEAN: u8 = 0x01;
const OCTET_STRING: u8 = 0x04;
const VERSION: u8 = 0xa0;
const EXTENSIONS: u8 = 0xa3;
/// GeneralName uniformResourceIdentifier: [6] IMPLICIT IA5String.
const URI_NAME: u8 = 0x86;
/// id-ce-subjectAltName, 2.5.29.17.
const SUBJECT_ALT_NAME: &[u8] = &[0x55, 0x1d, 0x11];
/// More SAN entries than any certificate rota makes or accepts.
const MAX_NAMES: usize = 256;

/// One tag-length-value and what follows it.
fn next(input: &[u8]) -> Result<(u8, &[u8], &[u8]), DerError> {
    let (&tag, rest) = input.split_first().ok_or(DerError("truncated tag"))?;
    if tag & 0x1f == 0x1f {
        return Err(DerError("multi-byte tags are not used in certificates"));
    }
    let (&first, rest) = rest.split_first().ok_or(DerError("truncated length"))?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let count = (first & 0x7f) as usize;
        if count == 0 || count > 4 || rest.len() < count {
            return Err(DerError("bad length"));
        }
        let len = rest[..count].iter().fold(0usize, |acc, b| (acc << 8) | *b as usize);
        (len, &rest[count..])
    };
    if rest.len() < len {
        return Err(DerError("value longer than its input"));
    }
    Ok((tag, &rest[..len], &rest[len..]))
}

fn expect<'a>(input: &'a [u8], tag: u8, what: &'static str) -> Result<(&'a [u8], &'a [u8]), DerError> {
    let (found, body, rest) = next(input)?;
    if found != tag {
        return Err(DerError(what));
    }
    Ok((body, rest))
}

/// Read the serial and the SAN URIs of a DER-encoded X.509 certificate.
pub fn certificate_facts(der: &[u8]) -> Result<CertificateFacts, DerError> {
    let (certificate, _) = expect(der, SEQUENCE, "not a certificate sequence")?;
    let (tbs, _) = expect(certificate, SEQUENCE, "no tbsCertificate")?;
    let mut rest = tbs;
    let (tag, _, after) = next(rest)?;
    if tag == VERSION {
        rest = after;
    }
    let (serial, mut rest) = expect(rest, INTEGER, "no serial number")?;
    let mut uris = Vec::new();
    while !rest.is_empty() {
        let (tag, body, after) = next(rest)?;
        rest = after;
        if tag == EXTENSIONS {
            let (mut extensions, _) = expect(body, SEQUENCE, "extensions are not a sequence")?;
            while !extensions.is_empty() {
                let (extension, after) = expect(extensions, SEQUENCE, "an extension is not a sequence")?;
                extensions = after;
                read_extension(extension, &mut uris)?;
            }
        }
    }
    Ok(CertificateFacts { serial: serial.to_vec(), uris })
}

fn read_extension(extension: &[u8], uris: &mut Vec<String>) -> Result<(), DerError> {
    let (oid, rest) = expect(extension, OID, "an extension without its id")?;
    if oid != SUBJECT_ALT_NAME {
        return Ok(());
    }
    let (tag, body, after) = next(rest)?;
    let value = match tag {
        BOOLEAN => expect(after, OCTET_STRING, "subjectAltName without a value")?.0,
        OCTET_STRING => body,
        _ => return Err(DerError("subjectAltName without a value")),
    };
    let (mut names, _) = expect(value, SEQUENCE, "subjectAltName is not a sequence")?;
    while !names.is_empty() {
        let (tag, body, after) = next(names)?;
        names = after;
        if tag == URI_NAME {
            if uris.len() >= MAX_NAMES {
                return Err(DerError("too many subject alternative names"));
            }
            let uri = std::str::from_utf8(body).map_err(|_| DerError("a URI name is not text"))?;
            uris.push(uri.to_string());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_past_the_input_are_refused() {
        assert_eq!(next(&[0x30, 0x05, 0x01]), Err(DerError("value longer than its input")));
        assert_eq!(next(&[0x30, 0x85, 0, 0, 0, 0, 1]), Err(DerError("bad length")));
        assert_eq!(next(&[0x30]), Err(DerError("truncated length")));
        assert!(certificate_facts(&[]).is_err());
        assert!(certificate_facts(b"not a certificate at all").is_err());
    }

    #[test]
    fn long_form_lengths_are_read() {
        let mut input = vec![0x04, 0x81, 0x80];
        input.extend(std::iter::repeat_n(7u8, 0x80));
        let (tag, body, rest) = next(&input).expect("valid");
        assert_eq!((tag, body.len(), rest.len()), (0x04, 0x80, 0));
    }
}
