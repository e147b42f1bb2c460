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

/// UTCTime and GeneralizedTime (RFC 5280 section 4.1.2.5).
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;

/// When a DER-encoded X.509 certificate stops being valid (its notAfter),
/// in seconds since the Unix epoch.
pub fn not_after_unix_s(der: &[u8]) -> Result<i64, DerError> {
    let (certificate, _) = expect(der, SEQUENCE, "not a certificate sequence")?;
    let (tbs, _) = expect(certificate, SEQUENCE, "no tbsCertificate")?;
    let mut rest = tbs;
    let (tag, _, after) = next(rest)?;
    if tag == VERSION {
        rest = after;
    }
    let (_serial, rest) = expect(rest, INTEGER, "no serial number")?;
    let (_signature, rest) = expect(rest, SEQUENCE, "no signature algorithm")?;
    let (_issuer, rest) = expect(rest, SEQUENCE, "no issuer")?;
    let (validity, _) = expect(rest, SEQUENCE, "no validity")?;
    let (_, _, after_not_before) = next(validity)?;
    let (tag, time, _) = next(after_not_before)?;
    let text = std::str::from_utf8(time).map_err(|_| DerError("notAfter is not text"))?;
    match tag {
        // YYMMDDHHMMSSZ; years 50-99 are 19xx (RFC 5280).
        UTC_TIME if text.len() == 13 => {
            let yy = digits(&text[0..2])?;
            let year = if yy >= 50 { 1900 + yy } else { 2000 + yy };
            unix_s(year, &text[2..12])
        }
        GENERALIZED_TIME if text.len() == 15 => unix_s(digits(&text[0..4])?, &text[4..14]),
        _ => Err(DerError("notAfter is not a UTCTime or GeneralizedTime in Z form")),
    }
}

fn digits(text: &str) -> Result<i64, DerError> {
    if !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(DerError("a time field is not digits"));
    }
    text.parse().map_err(|_| DerError("a time field is not digits"))
}

/// Seconds since the epoch of `year` and "MMDDHHMMSS" (UTC).
fn unix_s(year: i64, rest: &str) -> Result<i64, DerError> {
    let (month, day) = (digits(&rest[0..2])?, digits(&rest[2..4])?);
    let (hour, minute, second) = (digits(&rest[4..6])?, digits(&rest[6..8])?, digits(&rest[8..10])?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 60 {
        return Err(DerError("a time field is out of range"));
    }
    Ok(days_from_civil(year, month, day) * 86_400 + hour * 3_600 + minute * 60 + second)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// days_from_civil).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_count_days_from_the_epoch() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(unix_s(2038, "0119031408"), Ok(2_147_483_648));
    }

    #[test]
    fn a_new_certificate_expires_when_issued_to() {
        let issued = crate::certs::new_ca(30).expect("a CA");
        let der = crate::pem::certificates_from_pem(issued.cert_pem.as_bytes()).expect("pem")[0].to_vec();
        let now_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_secs() as i64;
        let left_s = not_after_unix_s(&der).expect("a notAfter") - now_s;
        assert!((29 * 86_400..=31 * 86_400).contains(&left_s), "{left_s} s left");
        assert!(not_after_unix_s(b"not a certificate").is_err());
    }

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
