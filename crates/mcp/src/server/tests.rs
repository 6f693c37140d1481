use super::*;

#[test]
fn every_actionable_error_says_what_to_do_next() {
    for kind in [
        ErrorType::InvalidRequest,
        ErrorType::Unauthorized,
        ErrorType::InsufficientCredits,
        ErrorType::Forbidden,
        ErrorType::NotFound,
        ErrorType::Conflict,
        ErrorType::RateLimited,
        ErrorType::ServiceUnavailable,
    ] {
        let r = failure(CoreError::new(kind, "it went wrong")).expect("a tool result");
        assert_eq!(r.is_error, Some(true));
        let text = &r.content[0].as_text().unwrap().text;
        assert!(
            text.starts_with(&format!("{kind}: it went wrong. ")),
            "{text}"
        );
        assert!(
            text.len() > format!("{kind}: it went wrong. ").len() + 20,
            "{text}"
        );
    }
    let r = failure(CoreError::new(ErrorType::RateLimited, "slow down").with_retry_after(7));
    assert!(r.unwrap().content[0]
        .as_text()
        .unwrap()
        .text
        .contains("Retry in 7 s"));
    assert!(failure(CoreError::internal("bug")).is_err());
}
