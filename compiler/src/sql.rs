//! The placeholders of a `db_read` / `db_write` query, counted at create
//! time so a query written for another database's placeholder style, or
//! with a `params` list of the wrong length, is a warning instead of a
//! driver error on the first request.

/// The SQL dialect of a connector, from its connection string's scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    Postgres,
    MySql,
    Sqlite,
}

impl Dialect {
    /// The dialect of a `connection_string` (`None` for an `env://`
    /// reference or an unknown scheme).
    pub fn of(connection_string: &str) -> Option<Dialect> {
        let (scheme, _) = connection_string.trim().split_once(':')?;
        match scheme.to_ascii_lowercase().as_str() {
            "postgres" | "postgresql" => Some(Dialect::Postgres),
            "mysql" | "mariadb" => Some(Dialect::MySql),
            "sqlite" => Some(Dialect::Sqlite),
            _ => None,
        }
    }
}

/// What a query holds outside its strings, quoted names and comments.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Placeholders {
    /// Plain `?` marks.
    pub question: usize,
    /// The highest `$n`.
    pub numbered: usize,
    /// SQLite's other forms (`?NNN`, `:name`, `@name`, `$name`).
    pub named: bool,
}

/// Scans `query` as `dialect` reads it.
pub fn placeholders(query: &str, dialect: Dialect) -> Placeholders {
    let b = query.as_bytes();
    let mut out = Placeholders::default();
    let mut i = 0;
    // Non-ASCII letters (their UTF-8 bytes) are name characters too.
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80;
    while i < b.len() {
        let c = b[i];
        match c {
            // PostgreSQL's `E'…'` takes backslash escapes (an `E` that ends
            // a longer name is not one).
            b'\''
                if dialect == Dialect::Postgres
                    && i > 0
                    && matches!(b[i - 1], b'E' | b'e')
                    && (i < 2 || !ident(b[i - 2])) =>
            {
                i = skip_quoted(b, i, true)
            }
            // MySQL reads backslash escapes in both kinds of quoted text.
            b'\'' | b'"' | b'`' => i = skip_quoted(b, i, dialect == Dialect::MySql && c != b'`'),
            // `$`, `:` and `@` inside a name (`amount$1`) mark nothing.
            b'$' | b':' | b'@' if i > 0 && ident(b[i - 1]) => i += 1,
            // SQLite also quotes names in brackets (`[a?]`).
            b'[' if dialect == Dialect::Sqlite => {
                i = b[i..]
                    .iter()
                    .position(|&c| c == b']')
                    .map_or(b.len(), |n| i + n + 1)
            }
            // MySQL takes `--` as a comment only before a space or a
            // control byte (`5--?` is five minus minus a value).
            b'-' if b.get(i + 1) == Some(&b'-')
                && (dialect != Dialect::MySql || b.get(i + 2).is_none_or(|&c| c <= b' ')) =>
            {
                i = skip_line(b, i)
            }
            b'#' if dialect == Dialect::MySql => i = skip_line(b, i),
            // MySQL's and MariaDB's executable comments (`/*! … */`,
            // `/*M! … */`) are code: only their markers are skipped.
            b'/' if dialect == Dialect::MySql
                && (query[i..].starts_with("/*!") || query[i..].starts_with("/*M!")) =>
            {
                i += if b[i + 2] == b'!' { 3 } else { 4 };
            }
            // PostgreSQL's block comments nest; the others' end at the
            // first `*/`.
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let nests = dialect == Dialect::Postgres;
                let (mut depth, mut j) = (1, i + 2);
                while j < b.len() && depth > 0 {
                    if b[j] == b'*' && b.get(j + 1) == Some(&b'/') {
                        depth -= 1;
                        j += 2;
                    } else if nests && b[j] == b'/' && b.get(j + 1) == Some(&b'*') {
                        depth += 1;
                        j += 2;
                    } else {
                        j += 1;
                    }
                }
                i = j;
            }
            b'?' => {
                let digits = b[i + 1..].iter().take_while(|d| d.is_ascii_digit()).count();
                if digits > 0 && dialect == Dialect::Sqlite {
                    out.named = true;
                } else {
                    out.question += 1;
                }
                i += 1 + digits;
            }
            b'$' => {
                let digits = b[i + 1..].iter().take_while(|d| d.is_ascii_digit()).count();
                if digits > 0 {
                    let n: usize = query[i + 1..i + 1 + digits].parse().unwrap_or(usize::MAX);
                    if n == 0 {
                        // No PostgreSQL parameter; a SQLite named one.
                        out.named |= dialect == Dialect::Sqlite;
                    } else {
                        out.numbered = out.numbered.max(n);
                    }
                    i += 1 + digits;
                } else if dialect == Dialect::Postgres {
                    // A dollar-quoted string: `$$…$$` or `$tag$…$tag$`.
                    let tag_len = b[i + 1..].iter().take_while(|&&d| ident(d)).count();
                    if b.get(i + 1 + tag_len) == Some(&b'$') {
                        let tag = &query[i..i + 2 + tag_len];
                        let body = i + tag.len();
                        i = match query[body..].find(tag) {
                            Some(end) => body + end + tag.len(),
                            None => b.len(),
                        };
                    } else {
                        i += 1;
                    }
                } else {
                    if dialect == Dialect::Sqlite && b.get(i + 1).is_some_and(|&d| ident(d)) {
                        out.named = true;
                    }
                    i += 1;
                }
            }
            b':' | b'@' if dialect == Dialect::Sqlite => {
                let prev_colon = i > 0 && b[i - 1] == b':';
                let next = b.get(i + 1).copied();
                if !prev_colon && next.is_some_and(|d| ident(d) && !d.is_ascii_digit()) {
                    out.named = true;
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    out
}

/// Past the quoted text opening at `start` (`''` inside is a quote;
/// `backslash`: `\` escapes the next byte, as MySQL reads `'…'`).
fn skip_quoted(b: &[u8], start: usize, backslash: bool) -> usize {
    let q = b[start];
    let mut i = start + 1;
    while i < b.len() {
        if backslash && b[i] == b'\\' {
            i += 2;
        } else if b[i] == q {
            if b.get(i + 1) == Some(&q) {
                i += 2;
            } else {
                return i + 1;
            }
        } else {
            i += 1;
        }
    }
    b.len()
}

fn skip_line(b: &[u8], start: usize) -> usize {
    b[start..]
        .iter()
        .position(|&c| c == b'\n')
        .map_or(b.len(), |n| start + n + 1)
}

/// Why `query` will not bind `params` values on `dialect`, or `None` when
/// it may (a query this scan cannot judge, such as SQLite's named
/// parameters, is not warned of).
pub fn placeholder_problem(query: &str, params: usize, dialect: Dialect) -> Option<String> {
    let p = placeholders(query, dialect);
    let values = |n: usize| {
        if n == 1 {
            "1 value".to_owned()
        } else {
            format!("{n} values")
        }
    };
    match dialect {
        Dialect::Postgres if p.numbered == 0 && params > 0 => Some(format!(
            "PostgreSQL placeholders are $1, $2, …; this query has none for the {} of params{}",
            values(params),
            if p.question > 0 {
                " ('?' is the MySQL and SQLite style)"
            } else {
                ""
            }
        )),
        Dialect::Postgres if p.numbered != params => Some(format!(
            "the query's placeholders go up to ${}, but params gives {}",
            p.numbered,
            values(params)
        )),
        Dialect::MySql | Dialect::Sqlite if p.numbered > 0 && p.question == 0 => {
            if dialect == Dialect::MySql {
                Some(format!(
                    "MySQL and MariaDB placeholders are '?'; ${} is the PostgreSQL style",
                    p.numbered
                ))
            } else {
                // SQLite reads `$1` as a named parameter: it binds.
                None
            }
        }
        Dialect::MySql | Dialect::Sqlite if !p.named && p.numbered == 0 && p.question != params => {
            Some(format!(
                "the query has {} '?' placeholder{}, but params gives {}",
                p.question,
                if p.question == 1 { "" } else { "s" },
                values(params)
            ))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_outside_strings_names_and_comments() {
        let p = placeholders(
            "SELECT '?', \"a?\", $2 -- ? $9\n FROM t /* $7 ? */ WHERE a = ? AND b = $1",
            Dialect::Postgres,
        );
        assert_eq!(
            p,
            Placeholders {
                question: 1,
                numbered: 2,
                named: false
            }
        );
        // Dollar quoting, and MySQL's backslash escapes and `#` comments.
        assert_eq!(
            placeholders("SELECT $$ $3 ? $$, $tag$ $4 $tag$, $1", Dialect::Postgres).numbered,
            1
        );
        assert_eq!(
            placeholders(r"SELECT 'it\'s ?', ? # ?", Dialect::MySql).question,
            1
        );
        // MySQL: `--` needs a space after it to be a comment, and `/*! */`
        // is code (the cases the MariaDB server itself counts so).
        assert_eq!(placeholders("SELECT 5--? AS a", Dialect::MySql).question, 1);
        assert_eq!(placeholders("SELECT 5 -- ?", Dialect::MySql).question, 0);
        assert_eq!(
            placeholders("SELECT ? /*!99999 , ? */", Dialect::MySql).question,
            2
        );
        assert_eq!(placeholders("SELECT ? /* ? */", Dialect::MySql).question, 1);
        // PostgreSQL's escape strings, SQLite's bracketed names.
        assert_eq!(
            placeholders(r"SELECT E'it\'s ?', e'a\'b', $1", Dialect::Postgres).question,
            0
        );
        assert_eq!(
            placeholders(r"SELECT NAME'x\', ?", Dialect::Postgres).question,
            1
        );
        assert_eq!(
            placeholders("SELECT [a?] FROM t WHERE id = ?", Dialect::Sqlite).question,
            1
        );
        // Review: `$0`, names holding `$`, non-ASCII names, nested and
        // MySQL double-quoted text.
        assert_eq!(placeholders("SELECT $0", Dialect::Postgres).numbered, 0);
        assert!(placeholders("SELECT $0, $00", Dialect::Sqlite).named);
        assert_eq!(
            placeholders("SELECT amount$1 FROM t", Dialect::MySql).numbered,
            0
        );
        assert!(placeholders("SELECT * FROM t WHERE a = $é", Dialect::Sqlite).named);
        assert!(placeholders("SELECT * FROM t WHERE a = :é", Dialect::Sqlite).named);
        assert_eq!(
            placeholders("SELECT $é$ $2 $é$, $1", Dialect::Postgres).numbered,
            1
        );
        assert_eq!(
            placeholders("SELECT /* a /* b */ $9 */ $1", Dialect::Postgres).numbered,
            1
        );
        assert_eq!(
            placeholders(r#"SELECT "a\"b", ?"#, Dialect::MySql).question,
            1
        );
        for q in ["$", "?", "E'", "/*!", "--", "[", "$é", "'é", "/*", "$0"] {
            for d in [Dialect::Postgres, Dialect::MySql, Dialect::Sqlite] {
                placeholders(q, d);
                placeholder_problem(q, 1, d);
            }
        }
        assert!(placeholders("SELECT * FROM t WHERE a = :a", Dialect::Sqlite).named);
        assert!(!placeholders("SELECT a::int FROM t", Dialect::Sqlite).named);
        assert!(placeholders("SELECT ?1", Dialect::Sqlite).named);
    }

    #[test]
    fn problems_name_the_style_or_the_count() {
        use Dialect::*;
        assert_eq!(
            placeholder_problem("SELECT * FROM t WHERE id = $1", 1, Postgres),
            None
        );
        assert_eq!(
            placeholder_problem("SELECT * FROM t WHERE id = ?", 1, Postgres).as_deref(),
            Some(
                "PostgreSQL placeholders are $1, $2, …; this query has none for the 1 value of params ('?' is the MySQL and SQLite style)"
            )
        );
        assert_eq!(
            placeholder_problem("SELECT * FROM t WHERE a = $1 AND b = $2", 3, Postgres).as_deref(),
            Some("the query's placeholders go up to $2, but params gives 3 values")
        );
        // An unused `$2` binds: its value's type is sent (bind_pg).
        assert_eq!(placeholder_problem("SELECT $1, $3", 3, Postgres), None);
        // jsonb's `?` operator with no params is not a placeholder problem.
        assert_eq!(
            placeholder_problem("SELECT doc ? 'k' FROM t", 0, Postgres),
            None
        );
        assert_eq!(placeholder_problem("SELECT ? , ?", 2, MySql), None);
        assert_eq!(
            placeholder_problem("SELECT * FROM t WHERE id = $1", 1, MySql).as_deref(),
            Some("MySQL and MariaDB placeholders are '?'; $1 is the PostgreSQL style")
        );
        assert_eq!(
            placeholder_problem("SELECT * FROM t WHERE id = ?", 0, Sqlite).as_deref(),
            Some("the query has 1 '?' placeholder, but params gives 0 values")
        );
        assert_eq!(
            placeholder_problem("SELECT * FROM t WHERE id = $1", 1, Sqlite),
            None
        );
        assert_eq!(
            placeholder_problem("SELECT * FROM t WHERE id = :id", 1, Sqlite),
            None
        );
    }

    #[test]
    fn dialects_follow_the_scheme() {
        assert_eq!(Dialect::of("postgresql://u@h/db"), Some(Dialect::Postgres));
        assert_eq!(Dialect::of("MariaDB://root@h/db"), Some(Dialect::MySql));
        assert_eq!(Dialect::of("sqlite::memory:"), Some(Dialect::Sqlite));
        assert_eq!(Dialect::of("env://DB_URL"), None);
    }
}
