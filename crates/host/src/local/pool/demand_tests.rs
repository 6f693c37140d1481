use super::*;

#[test]
fn a_burst_is_the_most_creates_within_its_span_and_is_forgotten() {
    let t0 = Instant::now();
    let memory = Duration::from_secs(60);
    let mut d = Demand::default();
    assert_eq!(d.peak(), 0);
    // Three at once, then two spread out, then four within the span.
    for ms in [0, 5, 10, 20_000, 40_000, 50_000, 51_000, 52_000, 55_000] {
        d.record(t0 + Duration::from_millis(ms), memory);
    }
    assert_eq!(d.peak(), 4);
    // A minute after the first ones, they are forgotten.
    d.forget(t0 + Duration::from_millis(61_000), memory);
    assert_eq!(d.0.len(), 6);
    assert_eq!(d.peak(), 4);
    d.forget(t0 + Duration::from_millis(200_000), memory);
    assert_eq!(d.peak(), 0);
}
