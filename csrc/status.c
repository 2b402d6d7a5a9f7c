/*
 * status.c -- names of the sf_status codes and sf_fail (see status.h).
 */
#include "status.h"

#include <stdarg.h>
#include <stdio.h>

static const char *const NAMES[SF_NSTATUS] = {
    [SF_OK] = "SF_OK",
    [SF_EINVAL] = "SF_EINVAL",
    [SF_ETYPE] = "SF_ETYPE",
    [SF_ERANGE] = "SF_ERANGE",
    [SF_EOVERFLOW] = "SF_EOVERFLOW",
    [SF_ENOMEM] = "SF_ENOMEM",
    [SF_ETIMEOUT] = "SF_ETIMEOUT",
    [SF_EPEER] = "SF_EPEER",
    [SF_EINTR] = "SF_EINTR",
    [SF_EIO] = "SF_EIO",
    [SF_EUNSUPPORTED] = "SF_EUNSUPPORTED",
    [SF_EEXTERNAL] = "SF_EEXTERNAL",
    [SF_EMISMATCH] = "SF_EMISMATCH",
};

const char *sf_status_name(sf_status code)
{
    if ((unsigned)code >= SF_NSTATUS || NAMES[code] == NULL)
        return "SF_E?";
    return NAMES[code];
}

sf_status sf_fail(sf_error *err, sf_status code, const char *fmt, ...)
{
    if (err) {
        err->code = code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
        va_end(ap);
    }
    return code;
}
