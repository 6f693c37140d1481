//! What debugfs says, read: its runs of commands (`-f -`), each echoed
//! as `debugfs: <command>` before what it printed; `ls -p` listings;
//! `stat` descriptions. Pure text in, entries out, apart from the tools.

use super::{name_of, EntryKind, VolumeEntry};
use time::OffsetDateTime;

/// debugfs's echo of a command in a `-f` run.
const ECHO: &str = "debugfs: ";

/// Splits a `-f` run's output by command: each `(argument, lines)`.
pub(super) fn by_command(out: &str) -> Vec<(String, Vec<&str>)> {
    let mut runs: Vec<(String, Vec<&str>)> = Vec::new();
    for line in out.lines() {
        if let Some(cmd) = line.strip_prefix(ECHO) {
            let arg = cmd
                .split_once(' ')
                .map(|(_, a)| a.trim().trim_matches('"').to_string())
                .unwrap_or_default();
            runs.push((arg, Vec::new()));
        } else if let Some((_, lines)) = runs.last_mut() {
            lines.push(line);
        }
    }
    runs
}

/// `ls -p` runs: each directory's entries, inode and name (`.` and `..`
/// left out). A line
/// is `/inode/mode/uid/gid/name/size/`; a name holding a newline goes on
/// the next line, which does not start so.
pub(super) fn parse_listings(out: &str) -> Vec<(String, Vec<(u64, String)>)> {
    by_command(out)
        .into_iter()
        .map(|(arg, lines)| {
            let dir = arg.trim_start_matches("-p ").trim().trim_matches('"');
            let mut records: Vec<String> = Vec::new();
            for line in lines {
                let starts = line.starts_with('/')
                    && line[1..]
                        .split('/')
                        .next()
                        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
                match records.last_mut() {
                    // debugfs ends a listing with an empty line.
                    _ if line.is_empty() => {}
                    Some(last) if !starts => {
                        last.push('\n');
                        last.push_str(line);
                    }
                    _ => records.push(line.to_string()),
                }
            }
            let names = records
                .iter()
                .filter_map(|r| {
                    // inode/mode/uid/gid/name (no `/` in it)/size
                    let r = r.strip_prefix('/')?.strip_suffix('/')?;
                    let (r, _size) = r.rsplit_once('/')?;
                    let mut fields = r.splitn(5, '/');
                    let inode = fields.next()?.parse().ok()?;
                    let name = fields.nth(3)?;
                    (name != "." && name != ".." && !name.is_empty())
                        .then(|| (inode, name.to_string()))
                })
                .collect();
            (dir.to_string(), names)
        })
        .collect()
}

/// `stat` runs: each path asked, described (none when debugfs found
/// nothing there).
pub(super) fn parse_stats(out: &str) -> Vec<(String, Option<VolumeEntry>)> {
    by_command(out)
        .into_iter()
        .map(|(path, lines)| {
            let entry = parse_stat(&path, &lines);
            (path, entry)
        })
        .collect()
}

pub(super) fn parse_stat(path: &str, lines: &[&str]) -> Option<VolumeEntry> {
    let mut kind = None;
    let mut mode = None;
    let mut uid = None;
    let mut gid = None;
    let mut size = None;
    let (mut atime, mut mtime, mut ctime) = (None, None, None);
    let mut target = None;
    for line in lines {
        let words: Vec<&str> = line.split_whitespace().collect();
        if line.starts_with("Inode:") {
            let ty = line.split("Type:").nth(1)?.split("Mode:").next()?.trim();
            kind = Some(match ty {
                "regular" => EntryKind::File,
                "directory" => EntryKind::Directory,
                "symlink" => EntryKind::Symlink,
                _ => EntryKind::Unknown,
            });
            mode =
                u32::from_str_radix(line.split("Mode:").nth(1)?.split_whitespace().next()?, 8).ok();
        } else if line.starts_with("User:") {
            uid = words.get(1).and_then(|w| w.parse().ok());
            let at = |key: &str| words.iter().position(|w| *w == key).map(|i| i + 1);
            gid = at("Group:").and_then(|i| words.get(i)?.parse().ok());
            size = at("Size:").and_then(|i| words.get(i)?.parse().ok());
        } else if let Some(v) = line.trim_start().strip_prefix("atime:") {
            atime = parse_time(v);
        } else if let Some(v) = line.trim_start().strip_prefix("mtime:") {
            mtime = parse_time(v);
        } else if let Some(v) = line.trim_start().strip_prefix("ctime:") {
            ctime = parse_time(v);
        } else if let Some(v) = line.trim_start().strip_prefix("Fast link dest:") {
            target = Some(v.trim().trim_matches('"').to_string());
        }
    }
    let mtime = mtime?;
    Some(VolumeEntry {
        name: name_of(path),
        path: path.to_string(),
        kind: kind?,
        size: size?,
        mode: mode? & 0o7777,
        uid: uid?,
        gid: gid?,
        atime: atime.unwrap_or(mtime),
        ctime: ctime.unwrap_or(mtime),
        mtime,
        target,
    })
}

/// ` 0x6b16bc43:00000004 -- Mon Dec  7 …`: seconds, then the extra word
/// (nanoseconds above two bits that extend the seconds past 2038).
pub(super) fn parse_time(v: &str) -> Option<OffsetDateTime> {
    let raw = v.split_whitespace().next()?.strip_prefix("0x")?;
    let (secs, extra) = match raw.split_once(':') {
        Some((s, e)) => (s, u32::from_str_radix(e, 16).ok()?),
        None => (raw, 0),
    };
    let secs = i64::from(u32::from_str_radix(secs, 16).ok()? as i32);
    let secs = secs + (i64::from(extra & 3) << 32);
    OffsetDateTime::from_unix_timestamp(secs)
        .ok()?
        .replace_nanosecond(extra >> 2)
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listings_keep_spaces_and_newlines_in_names_and_leave_out_dots() {
        let out = "debugfs: ls -p \"/a b\"\n/12/040755/1000/1000/.//\n/2/040755/0/0/..//\n\
                   /13/100644/1000/0/f 1.txt/6/\n/14/100644/0/0/two\nlines/0/\n\n\
                   debugfs: ls -p \"/\"\n/2/040755/0/0/.//\n/12/040755/1000/1000/a b//\n\n";
        let listed = parse_listings(out);
        assert_eq!(
            listed,
            [
                (
                    "/a b".to_string(),
                    vec![(13, "f 1.txt".to_string()), (14, "two\nlines".to_string())]
                ),
                ("/".to_string(), vec![(12, "a b".to_string())]),
            ]
        );
    }

    #[test]
    fn a_stat_is_read_and_a_missing_one_is_none() {
        let out = "debugfs: stat \"/a b/f\"\n\
                   Inode: 13   Type: regular    Mode:  0640   Flags: 0x80000\n\
                   User:  1000   Group:     7   Project:     0   Size: 6\n\
                   \x20ctime: 0x6b16bc43:00000000 -- Mon Dec  7 14:01:39 2026\n\
                   \x20atime: 0x6b16bc44:00000000 -- Mon Dec  7 14:01:40 2026\n\
                   \x20mtime: 0x6b16bc45:00000000 -- Mon Dec  7 14:01:41 2026\n\
                   debugfs: stat \"/none\"\n";
        let stats = parse_stats(out);
        let e = stats[0].1.as_ref().unwrap();
        assert_eq!(
            (e.name.as_str(), e.kind, e.mode, e.uid, e.gid, e.size),
            ("f", EntryKind::File, 0o640, 1000, 7, 6)
        );
        assert_eq!(e.mtime.unix_timestamp() - e.ctime.unix_timestamp(), 2);
        assert_eq!(stats[1], ("/none".to_string(), None));
    }

    #[test]
    fn times_past_2038_and_with_nanoseconds_are_read() {
        let t = parse_time(" 0x6b16bc43:00000004 -- Mon Dec  7 14:01:39 2026").unwrap();
        assert_eq!(t.unix_timestamp(), 0x6b16bc43);
        assert_eq!(t.nanosecond(), 1);
        let t = parse_time(" 0x00000010:00000001 -- x").unwrap();
        assert_eq!(t.unix_timestamp(), 16 + (1 << 32));
        assert_eq!(
            parse_time(" 0x6b16bc43 -- old inode")
                .unwrap()
                .unix_timestamp(),
            0x6b16bc43
        );
    }
}
